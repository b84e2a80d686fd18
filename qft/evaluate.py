"""Accuracy by scoring: each candidate label word's log-likelihood at the answer position, best one wins.

The same scorer gives zero-shot accuracy before training and the final accuracy after, so the two are
comparable. Multi-token label words are scored exactly (sum of token log-probs) by extending a KV cache
of the prompt once per candidate, rather than re-running the prompt.
"""

from __future__ import annotations

import torch

from qft.data import Split, Task, batch
from qft.model import autocast, device_of


@torch.no_grad()
def label_scores(model, prompts: list[list[int]], label_tokens: list[list[int]], pad_id: int,
                 batch_size: int, dtype: torch.dtype) -> torch.Tensor:
    """(n, n_labels) log-likelihood of each label word after each prompt."""
    was_training = model.training
    model.eval()
    dev = device_of(model)
    out = []
    for start in range(0, len(prompts), batch_size):
        ids, mask, pos = (t.to(dev) for t in batch(prompts[start:start + batch_size], pad_id))
        with autocast(dev, dtype):
            res = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
        first = torch.log_softmax(res.logits[:, -1].float(), -1)
        scores = torch.stack([first[:, t[0]] for t in label_tokens], 1)
        cache = res.cache
        last = pos[:, -1:]
        for c, tokens in enumerate(label_tokens):
            if len(tokens) == 1:
                continue
            ext = torch.tensor(tokens[:-1], device=dev).expand(ids.shape[0], -1)
            k = ext.shape[1]
            with autocast(dev, dtype):
                r = model(input_ids=ext, attention_mask=torch.cat([mask, torch.ones_like(ext)], 1),
                          position_ids=last + 1 + torch.arange(k, device=dev), cache=cache, use_cache=True)
            lp = torch.log_softmax(r.logits.float(), -1)
            scores[:, c] += sum(lp[:, j, tokens[j + 1]] for j in range(k))
            cache.crop(-k)  # drop this candidate's tokens, keep the prompt
        out.append(scores)
    model.train(was_training)
    return torch.cat(out)


@torch.no_grad()
def exact_match(model, split: Split, tokenizer, batch_size: int, dtype: torch.dtype) -> list[bool]:
    """Greedy generation compared with the reference answer, whitespace-stripped."""
    was_training = model.training
    model.eval()
    dev = device_of(model)
    hits = []
    max_new = max(map(len, split.answers)) + 4
    for start in range(0, len(split.prompts), batch_size):
        ids, mask, _ = (t.to(dev) for t in batch(split.prompts[start:start + batch_size], tokenizer.pad_token_id))
        with autocast(dev, dtype):
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, use_cache=True)
        for row, ref in zip(gen[:, ids.shape[1]:], split.texts[start:start + batch_size]):
            hits.append(tokenizer.decode(row, skip_special_tokens=True).strip() == ref.strip())
    model.train(was_training)
    return hits


def accuracy(model, task: Task, split_name: str, tokenizer, batch_size: int, dtype: torch.dtype) -> float:
    split = task.splits[split_name]
    if task.kind == "instruction":
        hits = exact_match(model, split, tokenizer, batch_size, dtype)
        return sum(hits) / len(hits)
    scores = label_scores(model, split.prompts, task.label_tokens, tokenizer.pad_token_id, batch_size, dtype)
    return (scores.argmax(1) == torch.tensor(split.labels, device=scores.device)).float().mean().item()
