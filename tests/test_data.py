"""Data layer: dataset loaders and presets on the real files, malformed rows, prompt templates, the
resumable data cursor, and the synthetic arithmetic task (determinism, disjoint splits, solutions)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from qurl.data.cursor import DataCursor
from qurl.data.datasets import DataError, Example, load_dataset
from qurl.data.sets import SETS_DIR
from qurl.data.synthetic import arithmetic_task, in_eval_split, worked_solution
from qurl.data.templates import BOXED_INSTRUCTION, render_prompt

DATA = SETS_DIR  # the evaluation sets shipped with qurl


def _real(name: str) -> Path:
    path = DATA / name
    if not path.is_file():
        pytest.skip(f"reference data {path} not present")
    return path


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------- loaders on the real data sets


def test_gsm8k_preset_takes_the_number_after_hashes():
    path = _real("gsm8k_test.jsonl")
    exs = load_dataset(path, "gsm8k")
    assert len(exs) == 1319
    # Row 0 read by hand: Janet's ducks, "... #### 18".
    assert exs[0] == Example("gsm8k_test:0", exs[0].prompt, "18")
    assert exs[0].prompt.startswith("Janet")
    raw = [json.loads(line) for line in path.read_text().splitlines()]
    for ex, row in zip(exs, raw):
        tail = row["answer"].split("####")[-1].strip()
        assert ex.answer == tail.replace(",", "")
        assert re.fullmatch(r"-?\d+(\.\d+)?", ex.answer), ex.answer
    assert len({e.uid for e in exs}) == len(exs)
    assert load_dataset(path) == exs  # auto-detects gsm8k


@pytest.mark.parametrize(
    "name, fmt, rows, first_uid",
    [("math500.jsonl", "math500", 500, "math500:0"), ("aime24.jsonl", "aime", 30, "aime24:60"),
     ("amc23.jsonl", "amc", 40, "amc23:0")],
)
def test_math_presets(name, fmt, rows, first_uid):
    path = _real(name)
    exs = load_dataset(path, fmt)
    raw = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(exs) == rows and exs[0].uid == first_uid
    for ex, row in zip(exs, raw):
        assert ex.prompt == row["problem"]
        if isinstance(row["answer"], float):  # amc23 stores answers as floats: 27.0 -> "27"
            assert ex.answer == str(int(row["answer"])) and float(ex.answer) == row["answer"]
        else:
            assert ex.answer == row["answer"].strip()
        if "id" in row:
            assert ex.uid == f"{path.stem}:{row['id']}"
    assert load_dataset(path, "math") == exs == load_dataset(path)  # aliases and auto agree


def test_limit_and_uid_prefix():
    exs = load_dataset(_real("math500.jsonl"), "math", uid_prefix="m5", limit=3)
    assert [e.uid for e in exs] == ["m5:0", "m5:1", "m5:2"]


# ---------------------------------------------------------------- dapo / deepscaler formats, jsonl and parquet

DAPO_ROWS = [
    {"data_source": "math_dapo",
     "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 2+3?"}],
     "ability": "MATH", "reward_model": {"ground_truth": "5", "style": "rule-lighteval/MATH_v2"},
     "extra_info": {"index": "a1"}},
    {"data_source": "math_dapo", "prompt": [{"role": "user", "content": "Solve $x^2=4$, x>0."}],
     "ability": "MATH", "reward_model": {"ground_truth": "2", "style": "rule"}, "extra_info": {"index": "a2"}},
]
DEEPSCALER_ROWS = [
    {"problem": "Compute $\\frac{1}{2}+\\frac{1}{4}$.", "answer": "\\frac{3}{4}", "solution": "..."},
    {"problem": "How many primes are below 10?", "answer": "4", "solution": "2,3,5,7"},
]


def _write_parquet(path: Path, rows: list) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("writer, suffix", [(_write_jsonl, ".jsonl"), (_write_parquet, ".parquet")])
def test_dapo_format(tmp_path, writer, suffix):
    path = writer(tmp_path / f"dapo{suffix}", DAPO_ROWS)
    exs = load_dataset(path, "dapo")
    assert exs == [Example("dapo:0", "What is 2+3?", "5"), Example("dapo:1", "Solve $x^2=4$, x>0.", "2")]
    assert load_dataset(path) == exs  # auto-detect from `prompt` + `reward_model`


@pytest.mark.parametrize("writer, suffix", [(_write_jsonl, ".jsonl"), (_write_parquet, ".parquet")])
def test_deepscaler_format(tmp_path, writer, suffix):
    path = writer(tmp_path / f"ds{suffix}", DEEPSCALER_ROWS)
    exs = load_dataset(path, "deepscaler")
    assert exs == [Example("ds:0", DEEPSCALER_ROWS[0]["problem"], "\\frac{3}{4}"),
                   Example("ds:1", "How many primes are below 10?", "4")]


def test_custom_dotted_fields(tmp_path):
    rows = [{"q": {"text": "1+1?"}, "meta": {"gold": {"value": 2}}, "id": "x7"}]
    path = _write_jsonl(tmp_path / "c.jsonl", rows)
    exs = load_dataset(path, "custom", question_field="q.text", answer_field="meta.gold.value")
    assert exs == [Example("c:x7", "1+1?", "2")]
    with pytest.raises(ValueError, match="question_field"):
        load_dataset(path, "custom")


def test_json_array_file(tmp_path):
    path = tmp_path / "deepscaler.json"
    path.write_text(json.dumps(DEEPSCALER_ROWS, indent=2))  # pretty-printed: elements span many lines
    exs = load_dataset(path, "deepscaler")
    assert [e.answer for e in exs] == ["\\frac{3}{4}", "4"] and exs[1].uid == "deepscaler:1"
    bad = DEEPSCALER_ROWS + [{"problem": "p"}]
    path.write_text(json.dumps(bad, indent=2))
    starts = [n for n, line in enumerate(json.dumps(bad, indent=2).splitlines(), 1) if line == "  {"]
    first_line_of_third = starts[2]
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}:{first_line_of_third}: field 'answer' missing"):
        load_dataset(path, "deepscaler")
    path.write_text('[{"problem": "p", "answer": "1"},\n {"problem": "q" "answer": "2"}]')
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}:2: bad JSON"):
        load_dataset(path, "math")
    path.write_text("[]")
    assert load_dataset(path, "math") == []


# ---------------------------------------------------------------- malformed rows name file and line


@pytest.mark.parametrize(
    "bad_line, message",
    [("{not json", "bad JSON"),
     (json.dumps({"problem": "p"}), "field 'answer' missing"),
     (json.dumps({"problem": "p", "answer": ["1"]}), "field 'answer' has type list"),
     (json.dumps({"problem": 3, "answer": "1"}), "field 'problem' has type int"),
     (json.dumps({"problem": "p", "answer": True}), "field 'answer' has type bool"),
     (json.dumps({"problem": "  ", "answer": "1"}), "field 'problem' is empty"),
     (json.dumps(["problem", "answer"]), "expected a JSON object")],
)
def test_malformed_jsonl_row_names_file_and_line(tmp_path, bad_line, message):
    good = json.dumps({"problem": "p", "answer": "1"})
    path = tmp_path / "broken.jsonl"
    path.write_text(f"{good}\n\n{bad_line}\n{good}\n")  # blank line 2 is skipped; the bad row is line 3
    with pytest.raises(ValueError) as err:
        load_dataset(path, "math")
    assert f"{path}:3:" in str(err.value) and message in str(err.value)


def test_malformed_rows_in_other_formats(tmp_path):
    bad_dapo = dict(DAPO_ROWS[1], prompt=[{"role": "system", "content": "x"}])
    path = _write_jsonl(tmp_path / "d.jsonl", [DAPO_ROWS[0], bad_dapo])
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}:2: .*user message"):
        load_dataset(path, "dapo")
    path = _write_jsonl(tmp_path / "g.jsonl", [{"question": "q", "answer": "no hashes"}])
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}:1: .*####"):
        load_dataset(path, "gsm8k")
    path = _write_parquet(tmp_path / "p.parquet", [{"problem": "a", "answer": "1"}, {"problem": "b", "answer": None}])
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: row 2: field 'answer' has type NoneType"):
        load_dataset(path, "math")
    path = _write_jsonl(tmp_path / "dup.jsonl", [{"id": 1, "problem": "a", "answer": "1"}] * 2)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}:2: duplicate uid 'dup:1'"):
        load_dataset(path, "math")
    with pytest.raises(ValueError, match="cannot detect"):
        load_dataset(_write_jsonl(tmp_path / "u.jsonl", [{"a": 1}]))
    with pytest.raises(ValueError, match="unknown dataset fmt"):
        load_dataset(path, "mmlu")
    with pytest.raises(ValueError, match="not found"):
        load_dataset(tmp_path / "missing.jsonl")


# ---------------------------------------------------------------- templates


def test_templates():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")), unk_token="<unk>",
        chat_template="{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
                      "{% if add_generation_prompt %}<assistant>{% endif %}",
    )
    q = "12+34="
    assert render_prompt(q, "plain") == q
    boxed = render_prompt("What is 1+1?", "boxed")
    assert boxed == "What is 1+1?\nPlease reason step by step, and put your final answer within \\boxed{}."
    assert boxed.endswith(BOXED_INSTRUCTION)
    assert render_prompt("What is 1+1?", "chat", tokenizer=tok) == f"<user>{boxed}</s><assistant>"
    # A synthetic expression is asked as a question in the chat templates; other text is kept.
    assert render_prompt("12+34=", "chat", tokenizer=tok) == \
        f"<user>What is 12+34?\n{BOXED_INSTRUCTION}</s><assistant>"
    assert render_prompt("(1+2)*3=", "chat-1shot", tokenizer=tok) == (
        "<user>What is 2+5-4? Put your final answer within \\boxed{}.</s>"
        "<assistant>2+5-4 = 3. \\boxed{3}</s>"
        "<user>What is (1+2)*3? Put your final answer within \\boxed{}.</s><assistant>")
    assert "What is x=?" not in render_prompt("x=", "chat", tokenizer=tok)
    for template in ("chat", "chat-1shot"):
        with pytest.raises(ValueError, match="tokenizer"):
            render_prompt(q, template)
    with pytest.raises(ValueError, match="unknown prompt template"):
        render_prompt(q, "fancy")


# ---------------------------------------------------------------- data cursor


def test_cursor_epochs_are_permutations_and_differ():
    c = DataCursor(7, seed=3)
    got = c.take(7 * 3)
    epochs = [got[0:7], got[7:14], got[14:21]]
    assert all(sorted(e) == list(range(7)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3  # 3 distinct shuffles (P(collision) ~ 1e-3, seed fixed)
    assert (c.epoch, c.position) == (3, 0)
    assert DataCursor(7, seed=3).take(21) == got  # deterministic
    assert DataCursor(7, seed=4).take(7) != epochs[0]


def test_cursor_resume_equals_uninterrupted():
    straight = DataCursor(10, seed=11)
    expected = straight.take(4) + straight.take(9) + straight.take(15)
    a = DataCursor(10, seed=11)
    first = a.take(4) + a.take(9)
    state = json.loads(json.dumps(a.state_dict()))  # survives JSON
    b = DataCursor(10, seed=11)
    b.load_state_dict(state)
    assert (b.epoch, b.position) == (a.epoch, a.position) == (1, 3)
    assert first + b.take(15) == expected


def test_cursor_put_back_is_served_first_and_persisted():
    c = DataCursor(5, seed=0)
    taken = c.take(3)
    fresh_next = DataCursor(5, seed=0)
    fresh_next.take(3)
    c.put_back(taken[1:])
    state = c.state_dict()
    assert state["requeue"] == taken[1:] and c.pending == taken[1:]
    d = DataCursor(5, seed=0)
    d.load_state_dict(state)
    assert d.take(4) == taken[1:] + fresh_next.take(2)  # requeue FIFO, then the stream continues
    assert d.pending == []
    with pytest.raises(ValueError, match="put_back index 5"):
        c.put_back([5])


def test_cursor_refuses_foreign_state():
    state = DataCursor(5, seed=0).state_dict()
    with pytest.raises(ValueError, match="field 'n'"):
        DataCursor(6, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="field 'seed'"):
        DataCursor(5, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="field 'position'"):
        DataCursor(5, seed=0).load_state_dict(dict(state, position=5))
    with pytest.raises(ValueError, match="missing field 'requeue'"):
        DataCursor(5, seed=0).load_state_dict({k: v for k, v in state.items() if k != "requeue"})


# ---------------------------------------------------------------- synthetic arithmetic


def test_synthetic_deterministic_distinct_and_correct():
    a = arithmetic_task(300, seed=5, split="train", n_operands=3, ops="+-*")
    assert a == arithmetic_task(300, seed=5, split="train", n_operands=3, ops="*-+")
    assert a != arithmetic_task(300, seed=6, split="train", n_operands=3, ops="+-*")
    assert len({e.prompt for e in a}) == 300 and len({e.uid for e in a}) == 300
    for e in a:
        # Python's own precedence rules are the reference for the rendered question.
        assert re.fullmatch(r"[\d+\-*()]+=", e.prompt)
        assert str(eval(e.prompt[:-1])) == e.answer and int(e.answer) >= 0
        assert all(10 <= int(x) <= 99 for x in re.findall(r"\d+", e.prompt))


def test_synthetic_splits_are_disjoint():
    train = arithmetic_task(5000, seed=1, split="train")
    evals = arithmetic_task(400, seed=2, split="eval")
    assert not {e.prompt for e in train} & {e.prompt for e in evals}
    assert all(in_eval_split(e.prompt) for e in evals) and not any(in_eval_split(e.prompt) for e in train)
    # The partition does not depend on the seed: another seed's train set avoids the same eval set.
    assert not {e.prompt for e in arithmetic_task(5000, seed=9, split="train")} & {e.prompt for e in evals}


def test_synthetic_capacity_and_arguments():
    # 1-digit a+b has 100 questions; ~10 of them are eval: 50 distinct eval questions cannot exist.
    with pytest.raises(ValueError, match="could only draw"):
        arithmetic_task(50, seed=0, split="eval", digits=1, ops="+")
    with pytest.raises(ValueError, match="split"):
        arithmetic_task(1, seed=0, split="test")
    with pytest.raises(ValueError, match="ops"):
        arithmetic_task(1, seed=0, split="train", ops="/")
    negatives = arithmetic_task(200, seed=0, split="train", ops="-", allow_negative=True)
    assert any(int(e.answer) < 0 for e in negatives)
    assert all(1000 <= int(x) <= 9999 for e in arithmetic_task(20, seed=0, split="train", digits=4)
               for x in re.findall(r"\d+", e.prompt))


@pytest.mark.parametrize("style", ["fold", "place", "answer"])
def test_worked_solutions_check_out(style):
    exs = arithmetic_task(200, seed=3, split="train", n_operands=3, ops="+-*", allow_negative=True)
    for e in exs:
        sol = worked_solution(e, style)
        assert sol.endswith(f"\\boxed{{{e.answer}}}")
        steps = sol[: -len(f"\\boxed{{{e.answer}}}")].strip()
        if style == "answer":
            assert steps == ""
            continue
        for step in steps.split(","):  # every step "a op b=c" is true arithmetic
            lhs, rhs = step.split("=")
            assert eval(lhs) == int(rhs), step
        assert int(steps.split(",")[-1].split("=")[1]) == int(e.answer)
    e = Example("arith:47+38=", "47+38=", "85")
    assert worked_solution(e) == "47+38=85 \\boxed{85}"
    assert worked_solution(e, "place") == "47+30=77,77+8=85 \\boxed{85}"
    assert worked_solution(Example("u", "12*34=", "408"), "place") == "12*30=360,12*4=48,360+48=408 \\boxed{408}"
    with pytest.raises(ValueError, match="evaluates to 85"):
        worked_solution(Example("u", "47+38=", "86"))
    with pytest.raises(ValueError, match="not an arithmetic question"):
        worked_solution(Example("u", "what is 2+2?", "4"))


def test_at_most_returns_every_distinct_question_of_a_small_task():
    """1-digit sums of two operands have < 200 distinct train questions: at_most=True returns the
    ones found (a prefix of any larger request) instead of raising."""
    with pytest.raises(ValueError, match="could only draw"):
        arithmetic_task(2000, seed=0, split="train", digits=1, n_operands=2)
    few = arithmetic_task(2000, seed=0, split="train", digits=1, n_operands=2, at_most=True)
    assert 50 < len(few) < 200 and len({e.prompt for e in few}) == len(few)
    # every one of them: the draw stops once it has them all (the space is counted), not earlier
    every = {f"{a}{op}{b}=" for a in range(10) for b in range(10) for op in "+-"
             if op == "+" or a >= b}
    assert {e.prompt for e in few} == {q for q in every if not in_eval_split(q)}
    assert few[:10] == arithmetic_task(10, seed=0, split="train", digits=1, n_operands=2)


def test_plain_question_answer_rows_are_detected(tmp_path):
    """A user's own set with plain `question` / `answer` strings loads with format auto (`qa`),
    numbers kept exact, while a `####` answer is still read as GSM8K."""
    path = tmp_path / "mine.jsonl"
    path.write_text('{"question": "What is 3+4?", "answer": "7"}\n'
                    '{"question": "Half of 5?", "answer": 2.5}\n'
                    '{"question": "Name x if x+1=3.", "answer": "\\\\frac{4}{2}"}\n')
    exs = load_dataset(path)
    assert [(e.uid, e.prompt, e.answer) for e in exs] == [
        ("mine:0", "What is 3+4?", "7"), ("mine:1", "Half of 5?", "2.5"),
        ("mine:2", "Name x if x+1=3.", "\\frac{4}{2}")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "1"}\n{"question": "q2"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: field 'answer' missing"):
        load_dataset(bad)
