"""One QLoRA fine-tune, top to bottom: config -> validate -> resolve the model (config only) -> data ->
base -> quantize -> adapters -> train -> evaluate -> result record.

Data comes before the weights so that every input problem (labels, splits, a max length too short for the
prompt) fails in seconds, before the heavy loading.
"""

from __future__ import annotations

import random
import shutil
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from qft import (accel, adapter, budget, data, evaluate, layers, logger, model, pipeline, quant, record, schema,
                 train, validate)
from qft.planning import stages
from qft.errors import QftError


_ONE_RUN = threading.Lock()  # a run seeds and draws from torch's global generator and sets its thread count


def run(cfg, run_dir: Path, keys=None) -> dict:
    """Run one fine-tune of the config `cfg` and write its record (result.json) into `run_dir`; returns the record.
    `keys`: the keys of the presets Hydra chose (qft.config.chosen), so a key appended to presets that lack it is
    refused. A run directory holding an ok record of the same config is left alone (a rerun sweep redoes only what
    failed). A failure is recorded with its reason, then re-raised (QftError for bad input). One run at a time per
    process: torch's generator and thread count are the process's, so a second concurrent run is refused."""
    if not _ONE_RUN.acquire(blocking=False):
        raise QftError("run_dir", str(run_dir), "another run is in progress in this process (on another thread); "
                       "torch's random generator is the process's, so runs go one at a time per process: start "
                       "this one after it, or in its own process")
    try:
        return _run(cfg, run_dir, keys)
    finally:
        _ONE_RUN.release()


def _run(cfg, run_dir: Path, keys) -> dict:
    started = time.time()
    schema.complete(cfg)  # the keys its presets leave out, at their defaults: the record holds every key
    _name_auto_dtype(cfg)
    previous = record.read(run_dir)
    rec = {"schema": record.SCHEMA, "status": "running", "config": record.resolved(cfg), "seed": cfg.seed,
           "versions": record.versions(), "execution": record.execution(cfg)}
    tracker = logger.Tracker()
    try:
        device = torch.device(validate.validate(cfg, keys=keys))  # first: a refused config reads and hashes nothing
        rec["inputs"] = inputs = record.inputs(cfg)
        rec["config_hash"] = config_hash = record.config_hash(cfg, inputs_=inputs)
        if previous and previous.get("status") == "ok" and not cfg.sweep.force and _same_cell(previous, rec):
            print(f"qft: {run_dir} already holds an ok record of this config; skipped (sweep.force=true reruns it)")
            return previous
        record.reset_peak_memory(device)
        accel.tune_host_allocator(accel.switches(cfg, device)["host_allocator"])
        source = model.resolve(cfg.model, cfg.cache_dir)
        rec["budget_ranks"] = budget.apply(cfg, budget.meta_layers(source)) if cfg.budget.params is not None else None
        validate.validate(cfg, depth=source.num_layers)
        # a pipeline's plan, before any weight: a budget too small or an unsupported model fails here
        stage_plan = stages.plan(cfg, source.model_type) if cfg.offload.mode == "pipeline" else None
        if stage_plan:
            rec["pipeline"] = stage_plan.__dict__
            # each stage draws its layers' dropout masks from its own process's random stream: the layout moves
            # the numbers (qft.frame.run_kind keeps such runs apart)
            rec["execution"]["pipeline"] = {"layers": stage_plan.layers, "micro_batches": cfg.offload.micro_batches}
            device = pipeline.init(cfg, device)
        tokenizer = model.load_tokenizer(source)
        task = data.prepare(cfg.data, tokenizer, cfg.cache_dir, cfg.seed)
        tracker = logger.make(cfg.logger, run_dir, cfg.experiment)
        tracker.params(record.flatten(rec["config"]))
        t_load = time.time()
        # a stage moves its own layers to its device
        built = build(cfg, source, torch.device("cpu") if stage_plan else device, trains_on=device)
        rec["load_seconds"] = time.time() - t_load
        rec["execution"].update(built.ran)
        print(f"qft: speed layer: {', '.join(k for k, v in built.ran.items() if v) or 'none'}")
        rec.update(_train_and_score(cfg, run_dir, config_hash, task, tokenizer, built, device, tracker, stage_plan,
                                    rec["execution"]))
    except BaseException as e:
        rec.update(status="failed", error=f"{type(e).__name__}: {e}", wall_seconds=time.time() - started)
        if not isinstance(e, QftError):
            rec["traceback"] = traceback.format_exc(limit=20)
        # a config refused before it was hashed leaves an ok record alone: nothing ran, and a check that reads the
        # machine (device=cuda, lm-eval, a records folder) must not undo a finished sweep rerun elsewhere
        kept = "config_hash" not in rec and previous and previous.get("status") == "ok"
        if pipeline.world()[0] == 0 and not kept:
            record.write(run_dir, rec)
        tracker.close("failed")
        raise
    if pipeline.world()[0] != 0:  # pipeline stages other than the first: rank 0 writes the record
        return rec
    rec["wall_seconds"] = time.time() - started
    record.write(run_dir, rec)
    tracker.metrics({f"{k}/{s}": v for k in ("zero_shot_accuracy", "final_accuracy")
                     for s, v in (rec.get(k) or {}).items()}, rec["steps"])
    tracker.close(rec["status"])
    return rec


def _same_cell(previous: dict, rec: dict) -> bool:
    """Whether an ok record already holds this run: the same config hash, or the same seed of the same cell made on
    another run kind (record.cell_key: a compute dtype that `auto` resolved otherwise there), so a study resumed on
    another CPU kind keeps its finished records instead of overwriting them."""
    if previous.get("config_hash") == rec["config_hash"]:
        return True
    return previous.get("seed") == rec["seed"] and "config" in previous and \
        record.cell_key(previous["config"], previous.get("inputs")) == record.cell_key(rec["config"], rec["inputs"])


def _name_auto_dtype(cfg) -> None:
    """Replace compute_dtype=auto by what it means on this machine, so the record and its hash say what ran."""
    if cfg.quant.compute_dtype == "auto":
        dev = "cuda" if cfg.device in ("cuda", "auto") and torch.cuda.is_available() else "cpu"
        cfg.quant.compute_dtype = model.compute_dtype_name("auto", dev)


@dataclass
class Built:
    """The quantized, adapter-wrapped model and what was planned for each projection."""

    model: object
    projections: list
    bits: dict
    plan: dict
    params: dict
    base_bytes: dict
    ran: dict


def build(cfg, source: model.Source, device: torch.device, trains_on: torch.device | None = None) -> Built:
    """A Built (network, projections, bits, plan, ...) of the config `cfg`: seeded, the base loaded from `source`,
    quantized and given adapters per layer type, on `device`, for training on `trains_on` (default `device`; a
    pipeline's stages build on the CPU). The build leaves the thread count it found, so the run computes at the
    count its record names."""
    threads = torch.get_num_threads()
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    net = model.load(source)
    model.attention_dtype(net, cfg.quant.attention_dtype)
    projections = layers.classify(net, source.model_type)
    on = accel.switches(cfg, trains_on or device)
    cached = quant.cache_file(cfg.quant, projections, model.fingerprint(source), device, cfg.cache_dir,
                              on["cache_dequantized"]) if on["cache_quantized"] else None
    bits = quant.quantize(net, cfg.quant, projections, device, cached, on["cache_dequantized"])
    base_bytes = quant.base_bytes(net, projections)
    net, plan = adapter.attach(net, cfg.adapter, projections, layers.architecture(source.model_type).shared_input)
    # the record's execution switches as installed (the compiled loops are CPU code)
    ran = accel.install(net, cfg, trains_on or device, projections, source.model_type, threads)
    depth_groups = {g: tuple(v["layers"]) for g, v in (cfg.adapter.depth_groups or {}).items()} or None
    if torch.get_num_threads() != threads:
        print(f"qft: note: torch's thread count moved from {threads} to {torch.get_num_threads()} while the model was "
              f"built; put back to {threads}", file=sys.stderr)
        torch.set_num_threads(threads)
    return Built(net, projections, bits, plan, adapter.count(plan, projections, depth_groups), base_bytes, ran)


def _train_and_score(cfg, run_dir: Path, config_hash: str, task, tokenizer, built: Built, device, tracker,
                     stage_plan: stages.Plan | None = None, execution: dict | None = None) -> dict:
    net = built.model
    dtype = model.compute_dtype(cfg.quant.compute_dtype, device)

    def acc(split: str) -> tuple[float, float | None]:
        """Accuracy and the mean log-likelihood of the gold label (None for instruction data): the learning curve."""
        scored = evaluate.score(net, task, split, tokenizer, cfg.train.eval_batch_size, dtype)
        ex = scored["examples"]
        ll = float(ex["loglik"][np.arange(len(ex["gold"])), ex["gold"]].mean()) if "loglik" in ex else None
        return scored["accuracy"], ll

    examples = {}  # per-example scores, "phase.split" -> arrays, written beside the record

    def accuracies(phase: str) -> dict:
        out = {}
        for s in ("val", "test"):
            scored = evaluate.score(net, task, s, tokenizer, cfg.train.eval_batch_size, dtype)
            out[s], examples[f"{phase}.{s}"] = scored["accuracy"], scored["examples"]
        return out

    adapted = built.params["total"] > 0
    lead = pipeline.world()[0] == 0  # in a pipeline, rank 0 holds the whole model and scores it
    zero_shot = accuracies("zero_shot") if lead and (cfg.train.zero_shot or not adapted) else None
    measured = None  # per-stage memory of a pipeline run
    job = train.Job(run_dir, config_hash, cfg.seed, evaluate=acc, track=tracker.metrics, execution=execution)
    if stage_plan:
        history, stage, measured = pipeline.train(net, task, cfg, stage_plan, dtype, tokenizer.pad_token_id, job,
                                                  device)
        pipeline.gather(net, stage, run_dir)
        if not lead:
            return {"status": "ok", "loss_curve": history.loss}
    elif adapted:
        history = train.train(task, cfg.train, job, train.answer_step(net, task, dtype, tokenizer.pad_token_id,
                                                                      cfg.offload))
    else:  # no adapter anywhere: the untrained base is the result
        history = train.History(completed=True)
    base = net.get_base_model() if adapted else net
    out = {
        "trainable_params": built.params,
        "base_bytes": built.base_bytes,
        "quant_per_module": {n: quant.describe(getattr(base.get_submodule(n), "base_layer", base.get_submodule(n)))
                             for n in built.bits},
        "data": {"task": task.kind, "labels": task.label_words, "cache_key": task.cache_key,
                 "sizes": {s: len(v.prompts) for s, v in task.splits.items()}},
        "zero_shot_accuracy": zero_shot,
        "pipeline_measured": measured,
        "loss_curve": history.loss,
        "val_curve": history.val_accuracy,
        "val_loglik_curve": history.val_loglik,
        "steps": history.step,
        "train_tokens": history.train_tokens,
        "train_tokens_per_second": history.train_tokens / max(history.train_seconds, 1e-9),
        "train_seconds": history.train_seconds,
        "device": str(device),
    }
    if len(history.executions) > 1:  # resumed: what ran each part, so a report sees a run that spans machines
        out["execution_history"] = history.executions
    if not history.completed:
        out.update(status="incomplete", memory=record.peak_memory(device))
        return out
    if adapted:
        out["final_accuracy"] = accuracies("final")
    else:  # the untrained base is the result: its scores are the zero-shot ones
        out["final_accuracy"] = zero_shot
        examples.update({f"final.{s}": examples[f"zero_shot.{s}"] for s in ("val", "test")})
    out["examples"] = record.write_examples(run_dir, examples, task.label_words)
    if adapted:
        net.save_pretrained(run_dir / "adapter", safe_serialization=True)
    out.update(evaluate.benchmarks(cfg, net, tokenizer, dtype))  # evaluate=mmlu: {"mmlu": {...}}; else nothing
    # the finished run supersedes it; kept until the benchmarks are done, so a run they fail resumes from it
    shutil.rmtree(run_dir / "checkpoint", ignore_errors=True)
    out.update(status="ok", adapter_dir=str(run_dir / "adapter") if adapted else None,
               memory=record.peak_memory(device))
    return out
