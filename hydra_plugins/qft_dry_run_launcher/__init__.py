"""qft's Hydra launcher plugin `hydra/launcher=dry_run` (see dry_run_launcher.py).

It lives in Hydra's `hydra_plugins` namespace because Hydra instantiates launchers only from there.
"""
