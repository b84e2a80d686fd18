"""Measured memory of a training step: the counterpart the memory model (qft.planning.footprint) is checked against."""

from __future__ import annotations

import torch

from qft import train


def measure_peak(fn, device: str | torch.device = "cpu") -> int:
    """The peak bytes of tensors held on `device` while `fn()` runs, beyond those held when it started.

    CUDA: the caching allocator's counter; CPU: torch.profiler's memory events, every allocation and free with the
    allocator's running total. Frees of earlier tensors are not reported, so a step freeing them is overestimated by
    at most their size. Why not RSS or a dispatch tracker: docs/memory.md."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    totals = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            totals.append((e.start_time_ns, e.extra_fields.total_allocated, e.extra_fields.alloc_size))
    if not totals:
        return 0
    totals.sort()
    base = totals[0][1] - totals[0][2]  # the running total just before the first event
    return max(0, max(t for _, t, _ in totals) - base)


def tensor_bytes(*objects) -> int:
    """The bytes of the distinct storages held by the modules and optimizers in `objects` (parameters, buffers,
    bitsandbytes quantization state, optimizer state): what stays resident between steps."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = t.untyped_storage()
            key = (st.data_ptr(), t.device)
            if key not in seen:
                seen.add(key)
                total += st.nbytes()

    for obj in objects:
        if isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                for v in state.values():
                    add(v)
            continue
        for t in list(obj.parameters()) + list(obj.buffers()):
            add(t)
            qs = getattr(t, "quant_state", None)
            if qs is not None:
                for x in (qs.absmax, qs.code, getattr(qs, "offset", None)):
                    add(x)
                if qs.state2 is not None:
                    add(qs.state2.absmax)
                    add(qs.state2.code)
            add(getattr(t, "SCB", None))
    return total


def measure_step(net, train_cfg, micro_batches: list, pad_id: int, dtype: torch.dtype) -> dict:
    """{"resident", "step", "peak"} bytes of one training step of `net` as qft.train runs it (`train_cfg`'s
    optimizer, clipping and checkpointing; answer loss with `pad_id` under `dtype`), measured on the second step.

    `micro_batches`: [(prompts, answers), ...] of one step; resident: model and optimizer state before the step."""
    from qft.model import device_of

    params = [q for q in net.parameters() if q.requires_grad]
    opt = train.make_optimizer(train_cfg, params)
    if train_cfg.gradient_checkpointing:
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    net.train()
    n_answer = sum(len(a) for _, answers in micro_batches for a in answers)

    def step():
        for prompts, answers in micro_batches:
            loss, _, _ = train.answer_loss(net, prompts, answers, pad_id, dtype)
            (loss / n_answer).backward()
            del loss
        if train_cfg.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(params, train_cfg.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # the first step allocates the optimizer states
    device = device_of(net)
    resident = torch.cuda.memory_allocated(device) if device.type == "cuda" else tensor_bytes(net, opt)
    peak = measure_peak(step, device)
    return {"resident": resident, "step": peak, "peak": resident + peak}
