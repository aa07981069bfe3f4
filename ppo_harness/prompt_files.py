"""Prompt files: a hub id, a dataset folder or a .json/.jsonl/.parquet/.csv file loaded as a
`datasets.Dataset`, each bad line or row named before any model loads (datasets names none), and the
default run's movie-review prompts built once from PyPI's vaderSentiment sdist."""
import json
import os
from pathlib import Path

from datasets import Dataset, DatasetDict, load_dataset, load_from_disk

from ppo_harness.keywords import TRAINER_KEYWORDS
from ppo_harness.writes import temporary_name

# built from PyPI's vaderSentiment sdist on first use
DEFAULT_PROMPTS = "cache/movie_review_prompts_v3.jsonl"


def load_prompt_dataset(name: str, config: str | None, split: str,
                        flag: str = "--dataset-name") -> Dataset:
    """A hub id, a directory written by `save_to_disk`, a dataset directory, or a
    json/jsonl/parquet/csv file (one split: `split` is not read); errors name `flag`."""
    path = Path(name)
    if path.is_file():
        kind = {".json": "json", ".jsonl": "json", ".parquet": "parquet",
                ".csv": "csv"}.get(path.suffix)
        if kind is None:
            raise ValueError(f"{flag} {name}: unsupported file type {path.suffix!r} (json, "
                             "jsonl, parquet, csv)")
        if kind == "json":
            check_json_file(path, flag)
        try:  # datasets fails on a file without rows with StopIteration or "corresponds to no data"
            return load_dataset(kind, data_files=str(path), split="train")
        except (StopIteration, ValueError) as error:
            raise ValueError(f"{flag} {name}: no rows could be read from "
                             f"this file ({error!r})") from None
        # datasets' DatasetGenerationError keeps the cause in a chained exception
        except Exception as error:
            raise ValueError(f"{flag} {name}: {error.__cause__ or error}") from error
    if path.is_dir() and ((path / "dataset_info.json").exists()
                          or (path / "dataset_dict.json").exists()):
        ds = load_from_disk(str(path))
        if isinstance(ds, DatasetDict):
            if split not in ds:
                raise ValueError(f"{flag} {name}: no split {split!r} (splits: {list(ds)})")
            ds = ds[split]
        return ds
    try:
        return load_dataset(name, config, split=split)
    except ValueError as e:  # datasets' message names the splits there are
        raise ValueError(f"{flag} {name}: cannot load split {split!r}: {e}") from e


def check_json_file(path: Path, flag: str) -> None:
    """Name the line of a .json/.jsonl file that is not UTF-8, not JSON or repeats a key (datasets
    names none)."""
    def unique_keys(pairs):
        keys = [k for k, _ in pairs]
        if len(set(keys)) < len(keys):
            raise ValueError("the key "
                             f"{next(k for k in keys if keys.count(k) > 1)!r} appears twice")
        return dict(pairs)

    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{flag} {path}: line {data[:error.start].count(10) + 1} is not UTF-8 "
                         f"(byte {data[error.start]:#04x}): save the file as UTF-8") from None
    try:  # one JSON document (an empty file: refused below, as having no rows)
        json.loads(text, object_pairs_hook=unique_keys) if text.strip() else None
        return
    except json.JSONDecodeError as error:
        if error.msg != "Extra data":
            raise ValueError(f"{flag} {path}: line {error.lineno} is not "
                             f"valid JSON ({error.msg})") from None
    except ValueError as error:
        raise ValueError(f"{flag} {path}: {error}") from None
    for number, line in enumerate(text.splitlines(), 1):  # JSON Lines
        try:
            if line.strip():
                json.loads(line, object_pairs_hook=unique_keys)
        except ValueError as error:
            raise ValueError(f"{flag} {path}: line {number} is not valid JSON "
                             f"({getattr(error, 'msg', error)})") from None


def check_text_columns(dataset: Dataset, source: str, columns: tuple[str, ...]) -> None:
    """Refuse a dataset without these columns, or a row whose value in one is not text (a null, a
    number), by row."""
    missing = [c for c in columns if c not in dataset.column_names]
    if missing:
        raise ValueError(f"{source}: columns {missing} are missing (has {dataset.column_names})")
    for column in columns:  # a null or a number would fail deep in the tokenizer, naming nothing
        row = next((i for i, value in enumerate(dataset[column]) if not isinstance(value, str)),
                   None)
        if row is not None:
            raise ValueError(f"{source}: row {row}'s {column} is "
                             f"{dataset[row][column]!r:.60}, not text")


def check_prompt_rows(dataset: Dataset, source: str, column: str) -> None:
    """Refuse a missing prompt column, a column named as a reward function's keyword, and, by row, a
    prompt that is neither text nor a list of messages, or whose kind differs from row 0's."""
    if column not in dataset.column_names:
        raise ValueError(f"--dataset-prompt-column {column!r} is not in {source} (columns: "
                         f"{dataset.column_names})")
    clash = {"prompts", "completions", *TRAINER_KEYWORDS} & set(dataset.column_names) - {column}
    if clash:  # every column is kept: reward functions get each as a keyword (`reward_components`)
        raise ValueError(f"{source}: column(s) {sorted(clash)} would collide with the keywords "
                         "reward functions are called with (prompts, completions, "
                         f"completion_ids, {', '.join(TRAINER_KEYWORDS)}): rename them")
    prompts = dataset[column]
    kinds = {str: "text", list: "a list of chat messages"}
    first = kinds.get(type(prompts[0]))
    for row, prompt in enumerate(prompts):
        if kinds.get(type(prompt)) is None or kinds.get(type(prompt)) != first:
            raise ValueError(f"{source}: row {row}'s prompt is {prompt!r:.60} "
                             f"({type(prompt).__name__}), but a prompt must be text or a list of "
                             f"chat messages, as row 0's ({first})")


def repeated_prompts(held_out: list, trained: list) -> int:
    """How many held-out prompts also appear among the training prompts (repeated rows in the file):
    their score measures memory, not generalisation."""
    seen = {json.dumps(prompt, sort_keys=True) for prompt in trained}
    return sum(json.dumps(prompt, sort_keys=True) in seen for prompt in held_out)


def build_movie_review_prompts(path: str, num_words: int = 8) -> None:
    """The default prompts: "Continue this movie review." and, as the answer's start, the first 8
    words of a Rotten Tomatoes snippet of the vaderSentiment sdist (pip download once), after an
    empty system turn (README)."""
    import io
    import subprocess
    import sys
    import tarfile
    import tempfile

    print(f"building {path} from the vaderSentiment sdist (once)")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary",
                        ":all:", "vaderSentiment==3.3.2", "-d", tmp], check=True)
        with tarfile.open(next(Path(tmp).glob("vaderSentiment-*.tar.gz"))) as sdist:
            inner = sdist.extractfile(next(m for m in sdist.getmembers()
                                           if m.name.endswith("hutto_ICWSM_2014.tar.gz")))
            with tarfile.open(fileobj=io.BytesIO(inner.read())) as resources:
                member = next(m for m in resources.getmembers()
                              if m.name.endswith("movieReviewSnippets_GroundTruth.txt"))
                lines = resources.extractfile(member).read().decode("utf-8").splitlines()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp_path = temporary_name(Path(path))
    with open(tmp_path, "w") as f:
        for line in lines:  # id <TAB> mean human sentiment rating <TAB> text
            words = line.strip().split("\t")[-1].split()
            if len(words) > num_words:
                # a prefix to continue
                prompt = [{"role": "system", "content": ""},
                          {"role": "user", "content": "Continue this movie review."},
                          {"role": "assistant", "content": " ".join(words[:num_words])}]
                f.write(json.dumps({"prompt": prompt}) + "\n")
    os.replace(tmp_path, path)


# ---- The prompts as token ids: text as it is, or chat messages through the chat template ---------
def tokenize_prompts(accelerator, dataset: Dataset, source: str, tokenizer, chat: bool, args,
                     model_config) -> Dataset:
    """`input_ids`, tokenised by the first process (the others read its cache); an empty or too
    long prompt refused."""
    with accelerator.main_process_first(), accelerator.local_main_process_first():
        dataset = dataset.map(
            lambda batch: {"input_ids": encode_prompts(tokenizer, batch[args.dataset_prompt_column],
                                                       chat)},
            batched=True)
    lengths = [len(ids) for ids in dataset["input_ids"]]
    if min(lengths) == 0:
        raise ValueError(f"{source}: a prompt tokenises to zero tokens")
    max_positions = getattr(model_config, "max_position_embeddings", None)
    if max_positions is not None and max(lengths) + args.response_length > max_positions:
        raise ValueError(f"{source}: the longest prompt ({max(lengths)} tokens) plus "
                         f"--response-length {args.response_length} exceeds the model's "
                         f"{max_positions} positions: shorten prompts or responses")
    return dataset


def encode_prompts(tokenizer, prompts: list, chat: bool | None = None) -> list[list[int]]:
    """Token ids of each prompt: text as it is, or messages rendered by the chat template
    (generation prompt)."""
    if not (isinstance(prompts[0], list) if chat is None else chat):
        return tokenizer(prompts)["input_ids"]
    if tokenizer.chat_template is None:
        raise ValueError("the prompts are chat messages, but the policy's tokenizer has no chat "
                         "template (a base model: give a text prompt column, or a tokenizer "
                         "with a chat template)")
    prompts = [as_messages(p) for p in prompts]
    for messages in prompts:
        if not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
            raise ValueError(f"a prompt is a list but not of {{'role', 'content'}} "
                             f"messages: {messages!r:.200}")
        roles = {m.get("role") for m in messages}
        if not roles <= {"system", "user", "assistant", "tool"}:
            raise ValueError(f"a prompt has an unknown role: {sorted(roles, key=str)} (known: "
                             "system, user, assistant, tool)")
    # a final assistant message is a prefix the policy continues, not a turn it answers (TRL 1.12
    # starts a new turn)
    texts = [tokenizer.apply_chat_template(m, add_generation_prompt=m[-1]["role"] != "assistant",
                                           continue_final_message=m[-1]["role"] == "assistant",
                                           tokenize=False)
             for m in prompts]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def as_messages(prompt) -> list[dict]:
    """A prompt as chat messages: a text prompt becomes one user turn."""
    return prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
