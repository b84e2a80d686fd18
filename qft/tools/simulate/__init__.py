"""Discrete-event simulator of pipeline-parallel fine-tuning with activation offload, from the command line:

    python -m qft.tools.simulate rtx3090x4 --model llama2-7b --seq-len 2048 --micro-batches 16

Predicts what each offload policy (Liu, Lai, Li, HPCC 2023 / CIBDA 2024: copies routed through an NVLink
neighbour's PCIe link) costs in step time and buys in peak memory on a described server, before any GPU is booked:
compute streams, links and per-GPU memory event by event. Modules, each importing only those before it: checks,
inputs, schedules, engine, policies, presets, loading, plots, report, cli.
"""

from __future__ import annotations

from qft.tools.simulate.checks import PLACEMENTS, POLICIES, SCHEDULES
from qft.tools.simulate.cli import main, parser
from qft.tools.simulate.engine import RELAY_SLOTS
from qft.tools.simulate.inputs import GB, Event, GiB, Policy, Result, Server, Stage, Workload
from qft.tools.simulate.loading import load, server_from_dict, workload_from_dict
from qft.tools.simulate.plots import COLOURS, plot_gantt, plot_peak_memory, plot_step_time, plot_sweep
from qft.tools.simulate.policies import AUTO_ROUNDS, compare, simulate, sweep
from qft.tools.simulate.presets import MODELS, SERVERS, ModelShape, workload_from_model
from qft.tools.simulate.report import describe, format_table, table_rows, write_outputs, write_sweep
from qft.tools.simulate.schedules import inflight, placement_of, schedule_order

__all__ = [
    "AUTO_ROUNDS", "COLOURS", "GB", "GiB", "MODELS", "PLACEMENTS", "POLICIES", "RELAY_SLOTS", "SCHEDULES", "SERVERS",
    "Event", "ModelShape", "Policy", "Result", "Server", "Stage", "Workload", "compare", "describe", "format_table",
    "inflight", "load", "main", "parser", "placement_of", "plot_gantt", "plot_peak_memory", "plot_step_time",
    "plot_sweep", "schedule_order", "server_from_dict", "simulate", "sweep", "table_rows", "workload_from_dict",
    "workload_from_model", "write_outputs", "write_sweep",
]
