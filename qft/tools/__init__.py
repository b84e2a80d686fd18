"""The tools around runs, each a `python -m qft.tools.<name>` command: report (records -> tables, plots, verdicts),
power (seeds and test size a study needs), memory (will a config fit), simulate (pipeline schedules on GPUs that
are not here), predict (a trained adapter on new texts). Nothing in the run path or planning imports them."""
