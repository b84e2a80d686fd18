import json
import tempfile
from collections import Counter

import pytest
import torch

from qft import data, record
from qft.errors import QftError
from conftest import make_cfg


def prepare(tokenizer, *overrides, cache=None, seed=None):
    """A task prepared into a fresh cache (or `cache`), so what is tested is today's code, never a cached result."""
    cfg = make_cfg(*overrides)
    return data.prepare(cfg.data, tokenizer, cache or tempfile.mkdtemp(prefix="qft-data-"), seed), cfg


def test_splits_are_seeded_disjoint_and_stratified():
    cfg = make_cfg("data.train_size=100", "data.val_size=25", "data.test_size=50")
    raw = data.SOURCES["bbc_news"](cfg.data)
    a, b = data.split(raw, cfg.data), data.split(raw, cfg.data)
    assert a == b
    texts = {k: {t for t, _ in v} for k, v in a.items()}
    assert not texts["train"] & texts["test"] and not texts["val"] & texts["test"] and not texts["train"] & texts["val"]
    assert {len(v) for v in a.values()} == {100, 25, 50}
    assert {lab for _, lab in a["test"]} == {"business", "entertainment", "politics", "sports", "tech"}
    assert sum(lab == "tech" for _, lab in a["test"]) == 10
    other = make_cfg("data.train_size=100", "data.val_size=25", "data.test_size=50", "data.split_seed=1")
    assert data.split(raw, other.data)["test"] != a["test"]


def test_split_seed_seed_draws_each_run_seeds_own_training_split_and_keeps_one_cell(tokenizer):
    """data.split_seed=seed: seeds 1 and 2 draw different training and validation documents (each the split an
    integer split_seed of that value draws), the same whole official test split, and their records share one cell
    key, so the report pools them as one cell's seeds."""
    sizes = ("data=reuters_r8", "data.train_size=40", "data.val_size=16", "data.test_size=2189")
    tasks = {s: prepare(tokenizer, *sizes, "data.split_seed=seed", f"seed={s}", seed=s)[0] for s in (1, 2)}
    fixed = prepare(tokenizer, *sizes, "data.split_seed=2")[0]
    assert tasks[1].splits["train"].prompts != tasks[2].splits["train"].prompts
    assert tasks[1].splits["val"].prompts != tasks[2].splits["val"].prompts
    assert sorted(map(tuple, tasks[1].splits["test"].prompts)) == sorted(map(tuple, tasks[2].splits["test"].prompts))
    assert tasks[2].splits == fixed.splits and tasks[2].cache_key == fixed.cache_key and tasks[1].cache_key != tasks[2].cache_key
    keys = {record.cell_key(record.resolved(make_cfg("data.split_seed=seed", f"seed={s}"))) for s in (1, 2)}
    assert len(keys) == 1
    with pytest.raises(QftError, match="data.split_seed"):
        data.prepare(make_cfg("data.split_seed=seed").data, tokenizer, tempfile.mkdtemp(prefix="qft-data-"))


def test_prompt_frames_text_and_answer_is_the_label_word(tokenizer):
    task, cfg = prepare(tokenizer, "data.train_size=20", "data.val_size=5", "data.test_size=5")
    s = task.splits["train"]
    for prompt, answer, label in zip(s.prompts, s.answers, s.labels):
        assert len(prompt) + len(answer) <= cfg.data.max_length
        assert answer == tokenizer(task.label_words[label], add_special_tokens=False)["input_ids"]
        text = tokenizer.decode(prompt)
        assert text.startswith("<|im_start|>system\nClassify the news article by topic.")
        assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert task.label_words == ["business", "entertainment", "politics", "sports", "tech"]


def test_tokenized_data_is_cached_by_content(tokenizer, monkeypatch, tmp_path):
    f = tmp_path / "r.csv"
    write_csv(f, [(f"review number {i}", "good" if i % 2 else "bad") for i in range(40)])
    local = ["data=local", f"data.path={f}", "data.text_column=review", "data.label_column=stars",
             "data.train_size=21", "data.val_size=5", "data.test_size=5"]
    first, _ = prepare(tokenizer, *local, cache=tmp_path)
    saved = []
    real_save = data._save_cache
    monkeypatch.setattr(data, "_save_cache", lambda *a: saved.append(a[0]) or real_save(*a))
    # the label words and frame are tokenized before the cache lookup; the examples only on a miss
    calls, real_encode = [], data._encode_many
    monkeypatch.setattr(data, "_encode_many", lambda tok, texts, keep: calls.append(texts) or real_encode(tok, texts, keep))
    task, _ = prepare(tokenizer, *local, cache=tmp_path)
    assert not calls and not saved and task.splits["train"].prompts == first.splits["train"].prompts
    write_csv(f, [(f"review number {i}", "good" if i % 3 else "bad") for i in range(40)])  # same texts, new labels
    changed, _ = prepare(tokenizer, *local, cache=tmp_path)
    assert calls and len(saved) == 1 and changed.cache_key != first.cache_key


def test_a_packaged_source_is_read_once_per_process_and_a_local_file_at_each_call(tokenizer, monkeypatch, tmp_path):
    import hashlib

    monkeypatch.setattr(data, "_READ", {})
    reads, real = [], dict(data.SOURCES)
    for name in ("bbc_news", "reuters_r8", "local"):
        monkeypatch.setitem(data.SOURCES, name, lambda c, name=name: reads.append(name) or real[name](c))
    sizes = ("data.train_size=21", "data.val_size=5", "data.test_size=5")
    first, cfg = prepare(tokenizer, *sizes, cache=tmp_path)
    again, _ = prepare(tokenizer, *sizes, cache=tmp_path)
    assert reads == ["bbc_news"] and again.cache_key == first.cache_key and again.splits == first.splits
    raw, digest = data._read(cfg.data)
    assert digest == hashlib.sha256(json.dumps(real["bbc_news"](cfg.data), sort_keys=True).encode()).hexdigest()
    assert all(isinstance(part, tuple) for part in raw.values())  # what a run holds cannot change the next run's
    prepare(tokenizer, "data=reuters_r8", *sizes, cache=tmp_path)  # another source: read, and the only one held
    assert list(data._READ) == ["reuters_r8"] and reads == ["bbc_news", "reuters_r8"]
    f = tmp_path / "r.csv"
    write_csv(f, [(f"review number {i}", "good" if i % 2 else "bad") for i in range(40)])
    local = ["data=local", f"data.path={f}", "data.text_column=review", "data.label_column=stars", *sizes]
    prepare(tokenizer, *local, cache=tmp_path)
    prepare(tokenizer, *local, cache=tmp_path)
    assert reads[2:] == ["local", "local"] and list(data._READ) == ["reuters_r8"]  # no bound on a file's size


def test_label_words_map_labels(tokenizer):
    task, _ = prepare(tokenizer, "data=election_tweets", "data.train_size=20", "data.val_size=5", "data.test_size=5")
    assert task.label_words == ["Clinton", "Trump"]


@pytest.mark.parametrize("name,n_labels", [("reuters_r8", 8), ("drug_reviews", 3), ("twenty_newsgroups", 20)])
def test_packaged_datasets_load(name, n_labels):
    cfg = make_cfg(f"data={name}")
    raw = data.SOURCES[name](cfg.data)
    labels = {lab for part in raw.values() for _, lab in part}
    assert len(labels) == n_labels
    assert "test" in raw and len(raw["test"]) > 100


def test_friends_transcripts_keep_the_six_main_speakers(tokenizer):
    """Speaker attribution over the six characters of over 1,000 lines; the 846 minor speakers would each be a label."""
    raw = data.SOURCES["friends_transcripts"](make_cfg("data=friends_transcripts").data)
    counts = Counter(who for _, who in raw["all"])
    assert sorted(counts) == ["Chandler", "Joey", "Monica", "Phoebe", "Rachel", "Ross"] and min(counts.values()) == 7496
    assert sum(counts.values()) == 51059 and list(raw) == ["all"]
    task, _ = prepare(tokenizer, "data=friends_transcripts", "data.max_length=96", "data.train_size=60",
                      "data.val_size=12", "data.test_size=60")
    assert task.label_words == sorted(counts) and Counter(task.splits["test"].labels) == {i: 10 for i in range(6)}


def write_csv(path, rows):
    path.write_text("review,stars\n" + "".join(f'"{t}",{s}\n' for t, s in rows))


def test_local_csv(tokenizer, tmp_path):
    f = tmp_path / "r.csv"
    write_csv(f, [(f"great product number {i}", "good") if i % 2 else (f"awful thing {i}", "bad") for i in range(40)])
    task, _ = prepare(tokenizer, "data=local", f"data.path={f}", "data.text_column=review", "data.label_column=stars",
                      "data.train_size=20", "data.val_size=5", "data.test_size=10")
    assert task.label_words == ["bad", "good"] and len(task.splits["test"].prompts) == 10


def test_local_alpaca_instruction_data(tokenizer, tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_text("".join(json.dumps({"instruction": f"Add {i} and 1.", "input": "", "output": str(i + 1)}) + "\n"
                         for i in range(30)))
    task, _ = prepare(tokenizer, "data=alpaca", f"data.path={f}", "data.train_size=20", "data.val_size=5",
                      "data.test_size=5")
    s = task.splits["test"]
    assert task.kind == "instruction" and s.answers[0][-1] == tokenizer.eos_token_id
    assert s.texts[0] == tokenizer.decode(s.answers[0][:-1])


@pytest.mark.parametrize("rows,key", [([(f"only one label {i}", "x") for i in range(30)], "data.label_column"),
                                       ([("a", "x"), ("b", "y")], "data.train_size")])
def test_bad_local_data(tokenizer, tmp_path, rows, key):
    f = tmp_path / "bad.csv"
    write_csv(f, rows)
    with pytest.raises(QftError) as e:
        prepare(tokenizer, "data=local", f"data.path={f}", "data.text_column=review", "data.label_column=stars",
                "data.train_size=5", "data.val_size=5", "data.test_size=5")
    assert e.value.key == key


def test_max_length_too_short_for_the_prompt(tokenizer):
    with pytest.raises(QftError) as e:
        prepare(tokenizer, "data.max_length=30")
    assert e.value.key == "data.max_length" and "needs at least" in str(e.value)


def test_prompt_length_and_padding_do_not_tell_the_label(tokenizer):
    # label words of 1 to 4 tokens; every BBC article overfills the 64-token budget
    task, cfg = prepare(tokenizer, "data.train_size=100", "data.val_size=25", "data.test_size=50",
                        "+data.label_words={business:business and finance news,tech:technology}")
    assert sorted(map(len, task.label_tokens)) != [len(task.label_tokens[0])] * 5  # the lengths do differ
    longest = max(map(len, task.label_tokens))
    for name, s in task.splits.items():
        by_label = {}
        for p, lab in zip(s.prompts, s.labels):
            by_label.setdefault(lab, set()).add(len(p))
        assert len(by_label) == 5
        assert all(v == {cfg.data.max_length - longest} for v in by_label.values()), (name, by_label)
        _, mask, pos = data.batch(s.prompts, tokenizer.pad_token_id)
        assert mask.all() and torch.equal(pos[0], pos[-1])  # no pad, the same positions: nothing to read the label from


def test_no_val_or_test_prompt_equals_a_training_prompt_as_the_model_sees_it(tokenizer):
    # Reuters repeats wire stories whose first lines agree: distinct raw texts, one prompt once truncated
    task, _ = prepare(tokenizer, "data=reuters_r8", "data.val_size=50", "data.test_size=200")
    seen = {n: {tuple(p) for p in s.prompts} for n, s in task.splits.items()}
    assert all(len(seen[n]) == len(task.splits[n].prompts) for n in seen)
    assert not seen["train"] & seen["test"] and not seen["train"] & seen["val"] and not seen["val"] & seen["test"]


def test_an_official_test_splits_own_stream_keeps_train_and_val_whatever_the_test_size():
    """A proportional draw (the studies') shuffles its test documents with the split's stream when that is shared,
    so the test size moves the validation and training draws after it; from its own stream it does not. (A balanced
    draw takes as many of the stream's numbers whatever the test size.)"""
    raw = data.SOURCES["reuters_r8"](make_cfg("data=reuters_r8").data)
    parts = {(stream, n): data.split(raw, make_cfg("data=reuters_r8", "data.val_size=50", f"data.test_size={n}",
                                                   "data.stratify=proportional", f"data.test_stream={stream}").data)
             for stream in ("shared", "own") for n in (200, 400)}
    small, large = parts["own", 200], parts["own", 400]
    assert small["train"] == large["train"] and small["val"] == large["val"]
    assert len(small["test"]) == 200 and len(large["test"]) == 400
    assert parts["shared", 200]["train"] != parts["shared", 400]["train"]  # the shared stream moves them
    assert parts["own", 200]["train"] != parts["shared", 200]["train"]  # another draw: hashed, never pooled
    own, shared = make_cfg("data.test_stream=own"), make_cfg()
    assert record.config_hash(own) != record.config_hash(shared)
    before = record.resolved(shared)  # a record made before the key existed still pools with the default
    del before["data"]["test_stream"]
    assert record.config_hash(before, inputs_=record.inputs(shared)) == record.config_hash(shared)
    with pytest.raises(QftError, match=r"^data.test_stream='own': needs an official test split, which bbc_news"):
        data.split(data.SOURCES["bbc_news"](make_cfg().data), make_cfg("data.test_stream=own").data)


def test_proportional_split_keeps_each_labels_share():
    cfg = make_cfg("data=drug_reviews", "data.stratify=proportional", "data.test_size=200", "data.val_size=50")
    raw = data.SOURCES["drug_reviews"](cfg.data)
    parts = data.split(raw, cfg.data)
    pool = data._unique(raw["test"])
    share = {lab: sum(l == lab for _, l in pool) / len(pool) for lab in {l for _, l in pool}}
    got = {lab: sum(l == lab for _, l in parts["test"]) for lab in share}
    assert sum(got.values()) == 200
    assert all(abs(got[lab] - 200 * share[lab]) < 1 for lab in share), (got, share)
    balanced = data.split(raw, make_cfg("data=drug_reviews", "data.test_size=200", "data.val_size=50").data)
    assert len({sum(l == lab for _, l in balanced["test"]) for lab in share}) < len(set(got.values())) + 1


def alpaca(tmp_path, rows):
    f = tmp_path / "a.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def test_instruction_data_is_split_at_random_by_the_split_seed(tokenizer, tmp_path):
    f = alpaca(tmp_path, [{"instruction": f"Say the word number {i}.", "input": "", "output": f"w{i:03d}"}
                          for i in range(120)])
    sizes = ["data.train_size=60", "data.val_size=20", "data.test_size=20"]
    tests = []
    for seed in (0, 1):
        task, _ = prepare(tokenizer, "data=alpaca", f"data.path={f}", f"data.split_seed={seed}", *sizes)
        tests.append(task.splits["test"].texts)
    assert tests[0] != tests[1]
    assert tests[0] != sorted(tests[0]) and max(tests[0]) > min(task.splits["train"].texts)


def test_instruction_prompts_keep_the_instruction_whole_and_fit_max_length(tokenizer, tmp_path, capfd):
    long_input = " ".join(f"word{i}" for i in range(200))
    rows = [{"instruction": f"Repeat the first word {i}.", "input": long_input, "output": f"word{i}"} for i in range(30)]
    rows += [{"instruction": "Write an essay.", "input": "", "output": " ".join(["essay"] * 100)} for _ in range(3)]
    rows += [{"instruction": "Do this: " + "very " * 80 + "long task.", "input": "x", "output": "ok"}]
    f = alpaca(tmp_path, rows)
    task, cfg = prepare(tokenizer, "data=alpaca", f"data.path={f}", "data.max_length=96", "data.train_size=20",
                        "data.val_size=5", "data.test_size=5")
    assert "left out 3 instruction examples" in capfd.readouterr().err  # the essays' answers are over 48 tokens
    for s in task.splits.values():
        for p, a, ref in zip(s.prompts, s.answers, s.texts):
            assert len(p) + len(a) <= cfg.data.max_length and a[-1] == tokenizer.eos_token_id
            assert tokenizer.decode(a[:-1]) == ref  # the answer whole, so exact match can hit it
            text = tokenizer.decode(p)
            assert f"Repeat the first word {ref[4:]}." in text and "<|im_start|>assistant" in text
    n = sum(len(s.prompts) for s in task.splits.values())
    assert n == 30  # 3 essays and the overlong instruction left out


def test_label_words_must_differ(tokenizer):
    with pytest.raises(QftError) as e:
        prepare(tokenizer, "data.train_size=20", "data.val_size=5", "data.test_size=5",
                "+data.label_words={business:news,tech:news}")
    assert e.value.key == "data.label_words" and "business:news,tech:news" in str(e.value)


def test_a_label_word_that_begins_another_is_refused(tokenizer):
    """A label scores as the sum of its tokens' log-probabilities: "news" then "news today" would score the longer
    at most the shorter's score on every example, so it could never be predicted (found with star ratings 1 and 10)."""
    assert tokenizer("news today", add_special_tokens=False)["input_ids"][:1] == \
        tokenizer("news", add_special_tokens=False)["input_ids"]
    for words in ("{business:news,tech:news today}", "{business:news today,tech:news}"):
        with pytest.raises(QftError) as e:
            prepare(tokenizer, "data.train_size=20", "data.val_size=5", "data.test_size=5",
                    f"+data.label_words={words}")
        assert e.value.key == "data.label_words" and "none the start of another's" in str(e.value)
    task, _ = prepare(tokenizer, "data.train_size=20", "data.val_size=5", "data.test_size=5",
                      "+data.label_words={business:news today,tech:today news}")  # sharing a token is fine
    assert "news today" in task.label_words


def test_a_split_smaller_than_asked_or_without_every_label_is_noted(tokenizer, tmp_path, capsys):
    """BBC News with 1,900 test articles leaves 2 training ones of the 100 asked, of 2 topics: said at every run,
    cache hit included (the record keeps the sizes); sizes that fit say nothing."""
    asked = ["data.train_size=100", "data.val_size=200", "data.test_size=1900"]
    task, _ = prepare(tokenizer, *asked, cache=tmp_path)
    err = capsys.readouterr().err
    n = len(task.splits["train"].labels)
    assert n < 100 and f"qft: note: data.train_size=100: the train split holds {n} examples, " in err
    assert "data.val_size=200: the val split holds" in err and "data.test_size" not in err
    prepare(tokenizer, *asked, cache=tmp_path)
    assert capsys.readouterr().err == err
    prepare(tokenizer, "data.train_size=100", "data.val_size=25", "data.test_size=50", cache=tmp_path)
    assert "qft: note: data." not in capsys.readouterr().err


def _plain_tokenizer(adds_bos: bool):
    """A word-level tokenizer without a chat template whose `add_bos_token` is unset; it puts <bos> before a text
    through its post-processor, as Gemma's converted from a GGUF does, or not at all."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<bos>", "<unk>", "Answer:", "a", "b"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if adds_bos:
        backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")


@pytest.mark.parametrize("adds_bos", [True, False])
def test_a_plain_frame_starts_with_bos_where_the_tokenizer_puts_one_first(adds_bos):
    tok = _plain_tokenizer(adds_bos)
    assert not tok.chat_template and not getattr(tok, "add_bos_token", False)
    cfg = make_cfg("data.instruction=null")
    _, _, prefix, suffix = data._frame_ends(cfg.data, tok, ["a", "b"])
    assert prefix == ([2] if adds_bos else [])
    assert suffix == [4]  # "\nAnswer: "
