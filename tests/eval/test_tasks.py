"""quantkit.eval.tasks: lm-eval's model over quantkit's forward, offline task loading, the recovery rule."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from quantkit.errors import InputError
from quantkit.eval import tasks
from quantkit.eval.tasks import TaskScore
from quantkit.eval.tasks import TaskGate
from quantkit.run.recipe import cli_tasks

VOCAB = 11


def fake_logits(ids):
    """Logits that depend on each position's own token and the one before (causal, padding-blind)."""
    prev = torch.roll(ids, 1, dims=1)
    prev[:, 0] = 0
    grid = torch.arange(VOCAB, dtype=torch.float32)
    return torch.sin(grid[None, None, :] * (ids[..., None] + 1) + prev[..., None] * 0.3)


def manual(context: list[int], continuation: list[int]) -> float:
    ids = torch.tensor([context + continuation])
    logprobs = torch.log_softmax(fake_logits(ids[:, :-1]), dim=-1)[0]
    start = len(context) - 1
    return sum(float(logprobs[start + i, t]) for i, t in enumerate(continuation))


def test_continuations_score_exactly_and_ignore_padding():
    pairs = [([1, 2, 3], [4, 5]), ([7], [1]), ([2, 2, 2, 2, 2, 2], [9, 3, 1])]
    together = tasks.score_continuations(fake_logits, pairs, 64, VOCAB)
    for (context, continuation), (logprob, _) in zip(pairs, together):
        assert logprob == pytest.approx(manual(context, continuation), abs=1e-5)
    alone = [tasks.score_continuations(fake_logits, [pair], 64, VOCAB)[0] for pair in pairs]
    assert [a[0] for a in alone] == pytest.approx([t[0] for t in together], abs=1e-6)
    greedy = int(fake_logits(torch.tensor([[7]]))[0, -1].argmax())
    assert tasks.score_continuations(fake_logits, [([7], [greedy])], 64, VOCAB)[0][1] is True


def test_long_contexts_are_cut_on_the_left():
    (logprob, _), = tasks.score_continuations(fake_logits, [(list(range(1, 10)), [3])], 4, VOCAB)
    assert logprob == pytest.approx(manual([6, 7, 8, 9], [3]), abs=1e-5)


def test_batches_stay_under_the_logits_budget(monkeypatch):
    monkeypatch.setattr(tasks, "BATCH_LOGITS_BYTES", 4 * VOCAB * 10)  # 10 tokens of logits
    groups = tasks.batches_by_length([5, 3, 5, 2, 1], VOCAB)
    assert groups == [[0, 2], [1, 3, 4]]


def test_recovery_rule():
    base, worse = TaskScore("t", "acc", 0.8, 0.01, 100), TaskScore("t", "acc", 0.76, 0.01, 100)
    assert tasks.recovery(base, worse) == pytest.approx(0.95)
    ppl_base = TaskScore("t", "word_perplexity", 10.0, None, 5, higher_is_better=False)
    ppl = TaskScore("t", "word_perplexity", 12.5, None, 5, higher_is_better=False)
    assert tasks.recovery(ppl_base, ppl) == pytest.approx(0.8)
    zero = TaskScore("t", "acc", 0.0, None, 4)
    assert tasks.recovery(zero, zero) == 1.0 and tasks.recovery(base, zero) == 0.0
    gate = [TaskGate(name="t", min_recovery=0.96)]
    (result,) = tasks.task_results([base], [worse], gate)
    assert not result.passed and result.samples == 100 and result.base == 0.8
    (check,) = tasks.task_checks([result])
    assert check.name == "task:t/acc" and check.op == ">=" and check.threshold == 0.96 and not check.passed


def test_cli_tasks_and_task_gate_schema():
    entries = cli_tasks("hellaswag, arc_easy:acc_norm", ["my.yaml"], 0.9)
    assert entries == [{"name": "hellaswag", "min_recovery": 0.9},
                       {"name": "arc_easy", "metric": "acc_norm", "min_recovery": 0.9},
                       {"file": "my.yaml", "min_recovery": 0.9}]
    assert TaskGate(name="x").min_recovery == 0.95
    with pytest.raises(ValueError, match="one of the two"):
        TaskGate(name="x", file="y.yaml")
    with pytest.raises(ValueError, match="one of the two"):
        TaskGate()


def test_task_file_data_files_resolve_against_the_yaml(tmp_path):
    pytest.importorskip("lm_eval", reason="task files are read with lm-eval (pip install 'quantkit[eval]')")
    (tmp_path / "t.yaml").write_text("task: t\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                     "    test: [a.jsonl, /abs/b.jsonl]\n")
    config = tasks.task_file_config(tmp_path / "t.yaml")
    assert config["dataset_kwargs"]["data_files"] == {"test": [str(tmp_path / "a.jsonl"), "/abs/b.jsonl"]}
    (tmp_path / "a.jsonl").write_text("{}\n")
    assert tasks.local_files(tmp_path / "t.yaml") == [tmp_path / "t.yaml", tmp_path / "a.jsonl"]  # hashed by --skip-existing


def test_missing_task_data_is_bad_input_naming_the_task(tmp_path):
    pytest.importorskip("lm_eval", reason="tasks run through lm-eval (pip install 'quantkit[eval]')")
    from quantkit.toy import make_continuation_task

    path = make_continuation_task(tmp_path, samples=4)
    (tmp_path / "quantkit_continuation.jsonl").unlink()
    with pytest.raises(InputError, match="task 'quantkit_continuation': its data is not available offline") as info:
        tasks.check_tasks([TaskGate(file=str(path))])
    assert "data_files" in info.value.hint


def test_generation_refuses_sampling():
    from quantkit.errors import UnsupportedError

    tasks.check_greedy({"do_sample": False, "temperature": 0.0})
    with pytest.raises(UnsupportedError, match="greedily"):
        tasks.check_greedy({"do_sample": True})


def test_lm_eval_scores_the_local_task_with_the_streamed_forward_as_the_model_object_does(micro_model, tmp_path):
    """The same weights through quantkit's streamed forward and through the transformers model object
    give lm-eval the same answers on a local multiple-choice task (offline, 6 samples)."""
    pytest.importorskip("lm_eval", reason="tasks run through lm-eval (pip install 'quantkit[eval]')")
    from quantkit.engines.transformers import load_model, load_tokenizer
    from quantkit.eval import scorers
    from quantkit.eval.evaluate import model_logits_fn
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.toy import make_continuation_task

    info = check_model_dir(micro_model)
    tokenizer = load_tokenizer(info, False)
    gate = [TaskGate(file=str(make_continuation_task(tmp_path, samples=6)))]
    streamed = tasks.run_tasks(scorers.base_logits(info, "float32"), tokenizer, 256, gate, None)
    loaded = tasks.run_tasks(model_logits_fn(load_model(info, "float32")), tokenizer, 256, gate, None)
    assert streamed[0].samples == 6 and streamed[0].metric == "acc"
    assert streamed[0].value == loaded[0].value and 0 <= streamed[0].value <= 1
    assert streamed[0].stderr == pytest.approx(loaded[0].stderr)


def test_continuation_task_is_lm_eval_multiple_choice(tmp_path):
    from quantkit.toy import make_continuation_task

    path = make_continuation_task(tmp_path, samples=5)
    lines = Path(path).with_suffix(".jsonl").read_text().splitlines()
    assert len(lines) == 5
    import json

    item = json.loads(lines[0])
    assert len(item["choices"]) == 4 and 0 <= item["label"] < 4 and not math.isnan(item["label"])
    assert "output_type: multiple_choice" in Path(path).read_text()
