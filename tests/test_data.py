import json

import pytest

from qft import data
from qft.errors import QftError
from conftest import make_cfg


def prepare(tokenizer, *overrides):
    cfg = make_cfg(*overrides)
    return data.prepare(cfg.data, tokenizer, cfg.cache_dir), cfg


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


def test_tokenized_data_is_cached_by_content(tokenizer, monkeypatch):
    prepare(tokenizer, "data.train_size=21", "data.val_size=5", "data.test_size=5")
    monkeypatch.setattr(data, "_save_cache", lambda *a: pytest.fail("rewrote the cache"))
    # the label words and frame are tokenized before the cache lookup; allow that, forbid the examples
    calls = []
    monkeypatch.setattr(data, "_encode", lambda tok, text: calls.append(text) or tok(text, add_special_tokens=False)["input_ids"])
    task, _ = prepare(tokenizer, "data.train_size=21", "data.val_size=5", "data.test_size=5")
    assert len(calls) == len(task.label_words) + 2
    assert len(task.splits["train"].prompts) == 21


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
