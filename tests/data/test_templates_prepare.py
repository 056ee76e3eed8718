"""Prompt templates and the verl parquet writer (read back through verl's own RLHFDataset)."""

import os

import pyarrow.parquet as pq
import pytest

from verl_ext.data.prepare import main as prepare_main
from verl_ext.data.prepare import to_verl_rows, write_verl_parquet
from verl_ext.data.templates import (
    MATH_INSTRUCTION,
    TEMPLATES,
    build_messages,
    chat_template_kwargs,
    render_prompt,
)
from verl_ext.data.toy.model import build_tokenizer

QWEN3_DIR = os.environ.get("HETERORL_QWEN3_TOKENIZER")  # folder with Qwen3 tokenizer.json + tokenizer_config.json


def test_messages_single_user_turn_with_instruction():
    msgs = build_messages("What is $1+1$?", "qwen3_think")
    assert msgs == [{"role": "user", "content": "What is $1+1$?\n" + MATH_INSTRUCTION}]
    assert build_messages("What is $1+1$?", "qwen3_nothink") == msgs  # thinking is a template kwarg
    assert build_messages("047+385=", "toy") == [{"role": "user", "content": "047+385="}]


def test_builtin_qwen3_rendering():
    think = render_prompt("Q?", "qwen3_think")
    nothink = render_prompt("Q?", "qwen3_nothink")
    head = "<|im_start|>user\nQ?\n" + MATH_INSTRUCTION + "<|im_end|>\n<|im_start|>assistant\n"
    assert think == head
    assert nothink == head + "<think>\n\n</think>\n\n"
    assert chat_template_kwargs("qwen3_nothink") == {"enable_thinking": False}
    assert chat_template_kwargs("plain") == {}


def test_plain_and_toy_rendering():
    plain = render_prompt("Q?", "plain")
    assert plain.startswith("Question: Q?\n") and plain.endswith("\nAnswer:") and "\\boxed{}" in plain
    assert render_prompt("047+385=", "toy") == "047+385="


@pytest.mark.skipif(not QWEN3_DIR, reason="set HETERORL_QWEN3_TOKENIZER to a Qwen3 tokenizer folder")
@pytest.mark.parametrize("template", ["qwen3_think", "qwen3_nothink"])
def test_builtin_rendering_equals_qwen3_chat_template(template):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(QWEN3_DIR)
    problem = r"Find $x$ if $\frac{x}{2} = 3$."
    assert render_prompt(problem, template, tokenizer=tok) == render_prompt(problem, template)


def test_render_with_toy_tokenizer_chat_template():
    tok = build_tokenizer()
    text = tok.apply_chat_template(build_messages("047+385=", "toy"), tokenize=False, add_generation_prompt=True)
    assert text == "<s>047+385="
    # the chat path (verl's agent loop: no special tokens added) and the plain path agree
    via_chat = tok(text, add_special_tokens=False)["input_ids"]
    assert via_chat == tok(render_prompt("047+385=", "toy"))["input_ids"]


@pytest.mark.parametrize(
    "problem,template,match",
    [
        ("Q", "qwen4", "qwen4"),
        ("", "plain", "problem"),
        ("47+385", "toy", "047\\+385="),
        ("a+b=", "toy", "a\\+b="),
    ],
)
def test_bad_template_or_problem_named(problem, template, match):
    with pytest.raises(ValueError, match=match):
        render_prompt(problem, template)


def test_chat_template_required_when_tokenizer_given():
    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="chat template"):
        render_prompt("Q", "qwen3_think", tokenizer=NoTemplate())


# ---------------------------------------------------------------------------------------------
# verl parquet


def test_rows_schema():
    recs = [{"id": "x/0", "problem": "1+1?", "answer": "2", "data_source": "x", "meta": {}}]
    (row,) = to_verl_rows(recs, "qwen3_think", split="test")
    assert row == {
        "data_source": "x",
        "prompt": [{"role": "user", "content": "1+1?\n" + MATH_INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "2"},
        "extra_info": {
            "index": 0,
            "id": "x/0",
            "split": "test",
            "problem": "1+1?",
            "answer": "2",
            "template": "qwen3_think",
        },
    }


def test_cli_math500_and_read_back(tmp_path, capsys):
    out = tmp_path / "sub" / "m.parquet"
    assert prepare_main(["--dataset", "math500", "--limit", "5", "--out", str(out)]) == 0
    assert "wrote 5 rows" in capsys.readouterr().out
    table = pq.read_table(out)
    assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    rows = table.to_pylist()
    assert [r["extra_info"]["index"] for r in rows] == list(range(5))
    assert rows[0]["reward_model"]["ground_truth"] == r"\left( 3, \frac{\pi}{2} \right)"
    assert rows[0]["prompt"][0]["role"] == "user"


def test_cli_nothink_prints_verl_hint_and_errors_are_clean(tmp_path, capsys, monkeypatch):
    out = tmp_path / "g.parquet"
    assert prepare_main(["--dataset", "gsm8k", "--limit", "2", "--template", "qwen3_nothink", "--out", str(out)]) == 0
    assert "enable_thinking=false" in capsys.readouterr().out
    monkeypatch.delenv("HETERORL_DATA_DIR", raising=False)
    assert prepare_main(["--dataset", "aime24", "--out", str(tmp_path / "a.parquet")]) == 2
    assert "aime24" in capsys.readouterr().err
    assert prepare_main(["--dataset", "math500", "--levels", "3", "--out", str(tmp_path / "b.parquet")]) == 2
    assert not (tmp_path / "b.parquet").exists()
    with pytest.raises(ValueError, match="parquet"):
        write_verl_parquet([{"id": "a", "problem": "p", "answer": "1", "data_source": "d"}], tmp_path / "x.csv")


def test_verl_rlhf_dataset_reads_toy_parquet_and_tokenizes_like_hf(tmp_path):
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    out = tmp_path / "toy.parquet"
    assert prepare_main(["--dataset", "toy", "--digits", "3", "--n", "8", "--seed", "5", "--out", str(out)]) == 0
    tok = build_tokenizer()
    cfg = OmegaConf.create({"prompt_key": "prompt", "max_prompt_length": 32, "cache_dir": str(tmp_path / "cache")})
    ds = RLHFDataset(data_files=[str(out)], tokenizer=tok, config=cfg)
    assert len(ds) == 8
    item = ds[3]
    problem = item["extra_info"]["problem"]
    assert item["raw_prompt"] == [{"role": "user", "content": problem}]
    assert item["reward_model"]["ground_truth"] == item["extra_info"]["answer"]
    assert item["data_source"] == "toy_add3" and item["index"] == 3
    # what verl's single-turn agent loop feeds the model == what HF generation feeds it
    ids = tok.apply_chat_template(item["raw_prompt"], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert list(ids) == tok(problem)["input_ids"]


# ---------------------------------------------------------------------------------------------
# the model's own chat template (chat, chat_1shot) and the math task's parquet pair

# SmolLM2-135M-Instruct's chat template (ChatML with a default system prompt), as its GGUF ships it
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SMOLLM2_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def chatml_tokenizer():
    tok = build_tokenizer()  # tiny character-level tokenizer; only its chat template matters here
    tok.chat_template = SMOLLM2_CHAT_TEMPLATE
    return tok


def test_chat_templates_render_through_the_models_own_chat_template():
    from verl_ext.data.templates import ONE_SHOT_EXAMPLE

    tok = chatml_tokenizer()
    problem = "  Ann has 2 cats and 3 dogs. How many pets? "
    assert render_prompt(problem, "chat", tokenizer=tok) == (
        SMOLLM2_SYSTEM
        + "<|im_start|>user\nAnn has 2 cats and 3 dogs. How many pets?\n"
        + MATH_INSTRUCTION
        + "<|im_end|>\n<|im_start|>assistant\n"
    )
    one_shot = render_prompt(problem, "chat_1shot", tokenizer=tok)
    assert one_shot == (
        SMOLLM2_SYSTEM
        + "<|im_start|>user\n"
        + MATH_INSTRUCTION
        + "\n\n"
        + ONE_SHOT_EXAMPLE
        + "\n\nProblem: Ann has 2 cats and 3 dogs. How many pets?\nSolution:<|im_end|>\n<|im_start|>assistant\n"
    )
    assert "\\boxed{5}" in ONE_SHOT_EXAMPLE and one_shot.count("\\boxed{") == 2  # instruction + example
    # verl applies the same template to the parquet's messages: the same text
    for template in ("chat", "chat_1shot"):
        messages = build_messages(problem, template)
        assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == render_prompt(
            problem, template, tokenizer=tok
        )
        assert chat_template_kwargs(template) == {}
    assert {"chat", "chat_1shot"} <= set(TEMPLATES)


@pytest.mark.parametrize("template", ["chat", "chat_1shot"])
def test_chat_templates_need_the_tokenizer(template):
    with pytest.raises(
        ValueError, match=f"template '{template}' applies the model's own chat template: pass its tokenizer"
    ):
        render_prompt("Q?", template)


GSM8K_EASY = {"split": "train", "max_steps": 2, "max_answer": 100, "max_question_chars": 200}


def test_math_assets_are_the_tasks_parquet_pair(tmp_path):
    from verl_ext.data.prepare import prepare_math_assets

    kwargs = dict(
        dataset="gsm8k",
        dataset_options=GSM8K_EASY,
        eval_dataset="gsm8k",
        eval_dataset_options={**GSM8K_EASY, "split": "test"},
        eval_size=5,
        template="chat_1shot",
    )
    assets = prepare_math_assets(tmp_path, **kwargs)
    assert (assets.n_train, assets.n_val) == (880, 5)
    assert assets.train_file.parent == assets.val_file.parent and assets.train_file.parent.parent == tmp_path
    train, val = pq.read_table(assets.train_file).to_pylist(), pq.read_table(assets.val_file).to_pylist()
    assert len(train) == 880 and len(val) == 5
    row = train[0]
    assert row["data_source"] == "gsm8k" and row["extra_info"]["template"] == "chat_1shot"
    assert row["prompt"] == build_messages(row["extra_info"]["problem"], "chat_1shot")
    assert row["extra_info"]["split"] == "train" and val[0]["extra_info"]["id"].startswith("gsm8k/test/")
    # same settings: same folder (rewritten); other settings: another folder
    assert prepare_math_assets(tmp_path, **kwargs).train_file == assets.train_file
    other = prepare_math_assets(tmp_path, **{**kwargs, "template": "chat"})
    assert other.train_file.parent != assets.train_file.parent


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"dataset_options": {"split": "train", "levels": [3]}}, TypeError, "takes no option.*levels"),
        (
            {"dataset_options": {"max_answer": 0, "max_steps": 1}},
            ValueError,
            "task.dataset with options .* selects no problem",
        ),
        ({"template": "qwen4"}, ValueError, "qwen4"),
        ({"eval_size": 0}, ValueError, "eval_size"),
    ],
)
def test_math_assets_errors_name_the_bad_value(tmp_path, change, error, match):
    from verl_ext.data.prepare import prepare_math_assets

    kwargs = {**dict(dataset="gsm8k", eval_dataset="gsm8k", eval_size=2, template="chat"), **change}
    with pytest.raises(error, match=match):
        prepare_math_assets(tmp_path, **kwargs)


def _write_many(path, rounds):
    records = [{"id": str(i), "problem": f"{i:03d}+001=", "answer": str(i + 1), "data_source": "d"} for i in range(200)]
    for _ in range(rounds):
        write_verl_parquet(records, path, template="toy", split="train")


def test_processes_writing_the_same_cached_parquet_at_once_all_succeed(tmp_path):
    """A learner and its pools, started together, fill one cache: each writes the file under a name
    of its own and renames it whole (a shared temporary name let one rename another's away)."""
    import multiprocessing

    path = tmp_path / "train.parquet"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_write_many, args=(path, 15)) for _ in range(3)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    assert [proc.exitcode for proc in procs] == [0, 0, 0]
    assert pq.read_table(path).num_rows == 200 and not list(tmp_path.glob(".*tmp"))
