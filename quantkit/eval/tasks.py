"""Task accuracy through lm-evaluation-harness, offline, and the recovery rule of the gate.

lm-eval is the task runner (its task YAMLs, prompts, metrics and standard errors); quantkit hands
it a model, `LogitsLM`: lm-eval's TemplateLM over a logits function (ids (b, L) -> float32 logits
(b, L, vocab)) built the way the gate reads the artifact (quantkit.formats.gate.artifact_logits:
a .gguf and the text decoders streamed layer by layer, bitsandbytes and the rest loaded through
transformers), so a task's score comes from the weights the gate measures. Loglikelihood and
rolling loglikelihood tasks run on every artifact kind; generation tasks run greedy decoding on
the same forward (sampling is refused).

Offline only: a task by name reads its dataset from the local Hugging Face cache; a task file is
lm-eval's own YAML (`dataset_path: json` with local `data_files`, resolved against the YAML's
folder when relative). Every task is loaded before any model work (`check_tasks`): data that is
not on this machine is an InputError (exit 2) naming the task.

The rule (llm-compressor's): per task, artifact score / base score >= min_recovery (0.95 by
default), inverted for a metric where lower is better. The base is scored once per run.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from pydantic import BaseModel, ConfigDict, Field, model_validator

from quantkit.errors import InputError, MissingExtraError, UnsupportedError
from quantkit.eval.generate import greedy_tokens, right_padded

if TYPE_CHECKING:
    from quantkit.eval.evaluate import Check, LogitsFn

BATCH_LOGITS_BYTES = 64 * 1024 * 1024  # float32 logits of one padded batch of requests
MAX_BATCH = 32  # requests per forward
BOOTSTRAP_ITERS = 1000  # lm-eval's bootstrap for the stderr of metrics that are not means
SEED = 0


class TaskGate(BaseModel):
    """One lm-evaluation-harness task in the gate (a recipe's `gate.tasks`, --tasks, --task-file): a task lm-eval
    knows by name (its data in the local Hugging Face cache) or a task YAML file of lm-eval's format."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, description="lm-eval task name (hellaswag, arc_easy, ...)")
    file: str | None = Field(None, description="a task YAML (lm-eval's format; dataset_path: json, local data_files)")
    metric: str | None = Field(None, description="the metric compared (default: the task's first, e.g. acc)")
    min_recovery: float = Field(0.95, ge=0, description="artifact score / base score at least this")

    @model_validator(mode="after")
    def _name_or_file(self) -> "TaskGate":
        if (self.name is None) == (self.file is None):
            raise ValueError("give a task `name` or a task `file`, one of the two")
        return self


@dataclass(frozen=True)
class TaskScore:
    """One model's score on one task metric (lm-eval's value, its stderr and the samples scored)."""

    task: str
    metric: str
    value: float
    stderr: float | None
    samples: int
    higher_is_better: bool = True


@dataclass(frozen=True)
class TaskBaseline:
    """The base's scores, once per run: {task limit: {task_key: TaskScore}}, and what scoring the
    artifacts the same way needs."""

    scores: dict
    tokenizer: object
    max_length: int


@dataclass(frozen=True)
class TaskResult:
    """Base and artifact on one task metric, and the recovery rule's verdict."""

    task: str
    metric: str
    base: float
    base_stderr: float | None
    score: float
    stderr: float | None
    samples: int
    recovery: float
    min_recovery: float
    passed: bool

    def as_dict(self) -> dict:
        return asdict(self)


# ------------------------------------------------------------------ loading tasks, offline


def require_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise MissingExtraError("lm-eval", "eval", "task accuracy (--tasks, --task-file, gate.tasks)") from None


@contextmanager
def offline_datasets() -> Iterator[None]:
    """quantkit.io.offline.offline() plus the datasets library's own copies of the switches (read
    at its import), so no task can reach the network for its data."""
    import datasets.config

    from quantkit.io.offline import offline

    saved = datasets.config.HF_DATASETS_OFFLINE, datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_DATASETS_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        with offline():
            yield
    finally:
        datasets.config.HF_DATASETS_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved


def task_file_config(path: str | Path) -> dict:
    """A task YAML as lm-eval reads it (its `include` and `!function` tags resolved), relative
    local data_files made absolute against the YAML's folder."""
    from lm_eval.tasks._yaml_loader import load_yaml

    path = Path(path)
    if not path.is_file():
        raise InputError(f"task file not found: {path}", hint="give a task YAML in lm-eval's format")
    try:
        config = load_yaml(path)
    except Exception as exc:  # yaml, include and !function errors alike
        raise InputError(f"{path}: not a task YAML lm-eval can read: {exc}".splitlines()[0],
                         hint="a task file is lm-eval's YAML with dataset_path: json and local data_files "
                              "(docs/gate.md, Task accuracy)") from exc
    if not isinstance(config.get("task"), str):
        raise InputError(f"{path}: a task file needs a `task:` name", hint="see lm-eval's task guide")
    kwargs = dict(config.get("dataset_kwargs") or {})
    if "data_files" in kwargs:
        kwargs["data_files"] = absolute_files(kwargs["data_files"], path.parent)
        config = {**config, "dataset_kwargs": kwargs}
    return config


def local_files(task_file: str | Path) -> list[Path]:
    """A task file and the local data files it reads (what --skip-existing hashes)."""
    files = (task_file_config(task_file).get("dataset_kwargs") or {}).get("data_files") or []
    return [Path(task_file), *sorted({Path(f) for f in flat_files(files) if Path(f).is_file()})]


def flat_files(files) -> list[str]:
    if isinstance(files, dict):
        return [f for value in files.values() for f in flat_files(value)]
    if isinstance(files, (list, tuple)):
        return [f for value in files for f in flat_files(value)]
    return [str(files)]


def absolute_files(files, folder: Path):
    """data_files (a path, a list, or a split -> path(s) mapping) with relative paths under `folder`."""
    if isinstance(files, dict):
        return {split: absolute_files(value, folder) for split, value in files.items()}
    if isinstance(files, (list, tuple)):
        return [absolute_files(value, folder) for value in files]
    return str(files) if Path(files).is_absolute() else str(folder / files)


def task_spec(task: "TaskGate") -> str | dict:
    """What lm-eval's get_task_dict takes for one gate task: a name, or a task file's config."""
    return task.name if task.file is None else task_file_config(task.file)


def task_name(task: "TaskGate") -> str:
    return task.name if task.file is None else task_file_config(task.file)["task"]


def with_task_files(tasks: list["TaskGate"]) -> list["TaskGate"]:
    """The gate's tasks with every name that a given task file defines (its `task:`) read from that file: a
    recipe's `{name: my_task, metric: acc}` and `--task-file my_task.yaml` are one task, my_task from the
    file with the named entry's metric and recovery rule (the file's own entry is then dropped)."""
    files = {task_file_config(t.file)["task"]: t.file for t in tasks if t.file is not None}
    named = {t.name for t in tasks if t.name in files}
    resolved = []
    for task in tasks:
        if task.name in files:
            resolved.append(task.model_copy(update={"name": None, "file": files[task.name]}))
        elif task.file is None or task_file_config(task.file)["task"] not in named:
            resolved.append(task)
    return resolved


def task_manager(by_name: bool):
    """lm-eval's TaskManager; its index of the built-in task YAMLs (slow to build) only when a task
    is given by name."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=by_name, verbosity="ERROR")


def load_task_dict(tasks: list["TaskGate"]) -> dict:
    """lm-eval's {name: Task} for the gate's tasks, datasets loaded offline; InputError (exit 2)
    naming a task lm-eval does not know or whose data is not on this machine."""
    require_lm_eval()
    from lm_eval.tasks import get_task_dict

    manager = task_manager(any(t.file is None for t in tasks))
    loaded = {}
    for task in tasks:
        spec = task_spec(task)
        name = spec if isinstance(spec, str) else spec["task"]
        if isinstance(spec, str) and spec not in manager.all_tasks:
            raise InputError(f"unknown lm-eval task '{spec}'",
                             hint="lm-eval's task names (lm-eval ls tasks), or write a task YAML and pass --task-file")
        try:
            with offline_datasets(), quiet_lm_eval():
                leaves = leaf_tasks(get_task_dict([spec], manager))
        except Exception as exc:
            raise missing_data_error(name, task, exc) from exc
        if name not in leaves:
            raise UnsupportedError(f"'{name}' is a group of {len(leaves)} lm-eval tasks; the gate takes single tasks",
                                   hint=f"name its tasks, e.g. --tasks {','.join(sorted(leaves)[:3])}")
        loaded.update(leaves)
    return loaded


def leaf_tasks(task_dict: dict) -> dict:
    """{task name: Task} of lm-eval's nested group dict."""
    leaves = {}
    for key, value in task_dict.items():
        if isinstance(value, dict):
            leaves.update(leaf_tasks(value))
        else:
            leaves[str(key)] = value
    return leaves


def missing_data_error(name: str, task: "TaskGate", exc: Exception) -> InputError:
    reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    if task.file is not None:
        hint = f"check dataset_path and data_files in {task.file} (relative paths are read from its folder)"
    else:
        hint = (f"put the dataset of '{name}' in the local Hugging Face cache (load it once with network access), "
                "or write a task YAML with dataset_path: json and local data_files and pass --task-file")
    return InputError(f"task '{name}': its data is not available offline ({reason})", hint=hint)


def check_tasks(tasks: list["TaskGate"]) -> list[str]:
    """Load every task once before any model work (exit 2 on missing data); their names."""
    return sorted(load_task_dict(tasks)) if tasks else []


# ------------------------------------------------------------------ the model lm-eval scores


def _template_lm():
    require_lm_eval()
    from lm_eval.api.model import TemplateLM

    return TemplateLM


def make_lm(logits_fn: "LogitsFn", tokenizer, max_length: int):
    """lm-eval's model over a logits function (LogitsLM)."""
    return logits_lm_class()(logits_fn, tokenizer, max_length)


def logits_lm_class():
    """LogitsLM, defined against lm-eval's TemplateLM once lm-eval is known to be installed."""

    class LogitsLM(_template_lm()):
        """lm-eval's TemplateLM over a logits function: requests are scored in right-padded batches
        (a causal model's logits at real positions do not see the padding after them); every
        context starts with the tokenizer's BOS where it has one, as the gate's windows do."""

        def __init__(self, logits_fn, tokenizer, max_length: int):
            super().__init__()
            self.logits_fn, self.tokenizer, self.max_length = logits_fn, tokenizer, max_length

        @property
        def eot_token_id(self) -> int:
            return self.tokenizer.eos_token_id

        @property
        def prefix_token_id(self) -> int:
            bos = self.tokenizer.bos_token_id
            return bos if bos is not None else self.eot_token_id

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
            return self.tokenizer(string, add_special_tokens=False)["input_ids"]

        def tok_decode(self, tokens: list[int]) -> str:
            return self.tokenizer.decode(tokens, skip_special_tokens=True)

        def with_bos(self, tokens: list[int]) -> list[int]:
            bos = self.tokenizer.bos_token_id
            return tokens if bos is None or (tokens and tokens[0] == bos) else [bos, *tokens]

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
            pairs = [(self.with_bos(list(context)), list(continuation)) for _, context, continuation in requests]
            answers = score_continuations(self.logits_fn, pairs, self.max_length, vocab_size(self.tokenizer))
            for (key, _, _), answer in zip(requests, answers):
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
            return answers

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

            totals = []
            for request in requests:
                tokens = self.tok_encode(request.args[0])
                windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1)]
                scored = score_continuations(self.logits_fn, [(list(c), list(t)) for c, t in windows],
                                             self.max_length, vocab_size(self.tokenizer))
                totals.append(sum(logprob for logprob, _ in scored))
            return totals

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            outputs = []
            for request in requests:
                context, gen_kwargs = request.args
                check_greedy(gen_kwargs)
                until = [s for s in as_list(gen_kwargs.get("until")) if s] or [self.tok_decode([self.eot_token_id])]
                prompt = self.with_bos(self.tok_encode(context))
                steps = int(gen_kwargs.get("max_gen_toks", 256))
                tokens = greedy_tokens(self.logits_fn, [prompt[-max(1, self.max_length - steps):]], steps,
                                       stop=self.eot_token_id,
                                       done_when=lambda out: any(s in self.tok_decode(out) for s in until))[0]
                outputs.append(cut_at(self.tok_decode(tokens), until))
            return outputs

    return LogitsLM


def vocab_size(tokenizer) -> int:
    return len(tokenizer)


def as_list(value) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def check_greedy(gen_kwargs: dict) -> None:
    """Generation tasks run greedy decoding; a task that samples is refused (exit 2)."""
    sampling = gen_kwargs.get("do_sample") or float(gen_kwargs.get("temperature", 0.0) or 0.0) > 0
    if sampling:
        raise UnsupportedError("this task samples its generations (do_sample / temperature > 0); quantkit's task "
                               "gate decodes greedily so base and artifact are compared on the same footing",
                               hint="set generation_kwargs do_sample: false, temperature: 0 in the task YAML")


def cut_at(text: str, until: list[str]) -> str:
    """The text up to the first stop string."""
    for stop in until:
        index = text.find(stop)
        if index >= 0:
            text = text[:index]
    return text


# ------------------------------------------------------------------ scoring and greedy decoding


def batches_by_length(lengths: list[int], vocab: int) -> list[list[int]]:
    """Request indices, longest first, grouped so one padded batch's float32 logits stay near
    BATCH_LOGITS_BYTES (at most MAX_BATCH requests)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups, current = [], []
    for index in order:
        longest = lengths[current[0]] if current else lengths[index]
        if current and (len(current) + 1) * longest * vocab * 4 > BATCH_LOGITS_BYTES or len(current) == MAX_BATCH:
            groups.append(current)
            current = []
        current.append(index)
    return groups + ([current] if current else [])


def score_continuations(logits_fn: "LogitsFn", pairs: list[tuple[list[int], list[int]]], max_length: int,
                        vocab: int) -> list[tuple[float, bool]]:
    """(sum of log p(continuation | context), whether greedy decoding gives the continuation) per
    pair; contexts are cut on the left so context + continuation fit max_length + 1 tokens."""
    import torch

    inputs = [(context + continuation)[-(max_length + 1):][:-1] for context, continuation in pairs]
    answers: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)
    with torch.inference_mode():
        for group in batches_by_length([len(x) for x in inputs], vocab):
            logprobs = torch.log_softmax(logits_fn(right_padded([inputs[i] for i in group])).float(), dim=-1)
            for row, index in enumerate(group):
                continuation = pairs[index][1]
                end = len(inputs[index])
                rows = logprobs[row, end - len(continuation) : end]
                target = torch.tensor(continuation, dtype=torch.long)
                logprob = float(rows.gather(1, target[:, None]).sum())
                answers[index] = (logprob, bool((rows.argmax(-1) == target).all()))
    return answers


# ------------------------------------------------------------------ running tasks and the rule


def run_tasks(logits_fn: "LogitsFn", tokenizer, max_length: int, tasks: list["TaskGate"],
              limit: int | None) -> list[TaskScore]:
    """Score the model on the gate's tasks with lm-eval (offline, seeded), one TaskScore per task."""
    from lm_eval.evaluator import simple_evaluate

    task_dict = load_task_dict(tasks)
    with offline_datasets(), quiet_lm_eval():
        results = simple_evaluate(model=make_lm(logits_fn, tokenizer, max_length), tasks=list(task_dict.values()),
                                  task_manager=task_manager(False), limit=limit, bootstrap_iters=BOOTSTRAP_ITERS,
                                  log_samples=False,
                                  random_seed=SEED, numpy_random_seed=SEED, torch_random_seed=SEED,
                                  fewshot_random_seed=SEED)
    return [task_score(results, task_dict, task) for task in tasks]


@contextmanager
def quiet_lm_eval() -> Iterator[None]:
    """lm-eval's INFO logging and the progress bars of lm-eval and datasets off while it runs
    (library code never prints)."""
    import logging

    import io
    from contextlib import redirect_stderr

    import datasets

    logger = logging.getLogger("lm_eval")
    saved, bars = logger.level, datasets.is_progress_bar_enabled()
    logger.setLevel(logging.ERROR)
    datasets.disable_progress_bars()
    try:
        with redirect_stderr(io.StringIO()):  # lm-eval's own tqdm bars
            yield
    finally:
        logger.setLevel(saved)
        if bars:
            datasets.enable_progress_bars()


def task_score(results: dict, task_dict: dict, task: "TaskGate") -> TaskScore:
    """The task's chosen metric (its first one without a metric given) from lm-eval's results."""
    name = task_name(task)
    values = results["results"][name]
    metrics = [key.split(",")[0] for key in values if "," in key and "_stderr" not in key]
    metric = task.metric or metrics[0]
    key = next((k for k in values if k.split(",")[0] == metric and "_stderr" not in k), None)
    if key is None:
        raise InputError(f"task '{name}' has no metric '{metric}'; it reports {', '.join(metrics)}",
                         hint=f"name one it reports, e.g. "
                              f"{name}:{metrics[0]}" if metrics else "check the task's metric_list")
    stderr = values.get(key.replace(",", "_stderr,", 1))
    better = task_dict[name].higher_is_better().get(metric, True)
    samples = int(results.get("n-samples", {}).get(name, {}).get("effective", 0))
    return TaskScore(name, metric, float(values[key]), number_or_none(stderr), samples, bool(better))


def number_or_none(value) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None  # lm-eval writes "N/A" where it has no stderr
    return number if math.isfinite(number) else None


def recovery(base: TaskScore, score: TaskScore) -> float:
    """score / base (base / score where lower is better); 1.0 when both are 0, 0.0 when only the
    one in the denominator is."""
    top, bottom = (score.value, base.value) if base.higher_is_better else (base.value, score.value)
    if bottom == 0:
        return 1.0 if top == 0 else (math.inf if top > 0 else 0.0)
    return top / bottom


def task_results(base: list[TaskScore], scores: list[TaskScore], tasks: list["TaskGate"]) -> list[TaskResult]:
    """The recovery rule per task metric (the three lists in the same order)."""
    results = []
    for b, s, task in zip(base, scores, tasks):
        r = recovery(b, s)
        results.append(TaskResult(s.task, s.metric, b.value, b.stderr, s.value, s.stderr, s.samples, r,
                                  task.min_recovery, math.isfinite(s.value) and r >= task.min_recovery))
    return results


def score_tasks(logits_fn: "LogitsFn", tokenizer, max_length: int, tasks: list["TaskGate"], limit: int | None,
                base: dict[str, TaskScore]) -> list[TaskResult]:
    """The artifact's scores on the gate's tasks against the base's (base_scores), rule applied."""
    scores = run_tasks(logits_fn, tokenizer, max_length, tasks, limit)
    return task_results([base[task_key(t)] for t in tasks], scores, tasks)


def base_scores(logits_fn: "LogitsFn", tokenizer, max_length: int, tasks: list["TaskGate"],
                limit: int | None) -> dict[str, TaskScore]:
    """The base's scores, once per run, by task_key (several targets' gates may name the same task)."""
    unique = list({task_key(t): t for t in tasks}.values())
    return {task_key(t): score for t, score in zip(unique, run_tasks(logits_fn, tokenizer, max_length, unique, limit))}


def task_key(task: "TaskGate") -> str:
    """What identifies a scored task metric: the name or file, and the metric."""
    return f"{task.name or Path(task.file).resolve()}:{task.metric or ''}"


def max_context(config: dict) -> int:
    """Tokens the model takes in one forward (its text config's max_position_embeddings; 2048 without one)."""
    text = config.get("text_config") or config
    return int(text.get("max_position_embeddings") or 2048)


def task_checks(results: list[TaskResult]) -> list["Check"]:
    """The gate's checks of the task results: `task:<name>/<metric>` recovery >= min_recovery."""
    from quantkit.eval.evaluate import Check

    return [Check(f"task:{r.task}/{r.metric}", r.recovery, r.min_recovery, ">=", r.passed) for r in results]
