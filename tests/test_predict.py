"""Predict-first questions: the answer comes from the measurement, and a learner who follows the text is read.

The notebook test runs each question as a learner would, in a real kernel: the notebook's own ask
cell, then its answer cell with None replaced by an answer in the variable the question names,
then its reveal cell (with the measurement, which takes launches, replaced by a measured value).
"""

import ast
from pathlib import Path

import nbformat
import pytest

from ddp_tutorial.lessons import predict

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
#: Per question, text that gives the answer away: no cell before the question may hold it.
GIVEAWAYS = {"01-all-reduce": ["= 10"], "03-set-epoch": ["train.start_epoch", "sampler_demo"],
             "04-allreduces": ["train.micro_step", 'diff("forward-outside-no-sync")'],
             "07-buckets": ["ddp_lab(", "7 all-reduces"],
             "08-uneven": ["Timed out waiting", "Nothing crashes", "--no-join", "hang, and", "batches hang"],
             "09-monitored": ["names the first one", "monitored=True", "failed to pass"]}
#: A value each question's measurement could give.
MEASURED = {"01-all-reduce": 10.0, "01-wrong-world-size": [0, 1], "02-default-buckets": 2,
            "03-set-epoch": True, "03-padding": 2, "04-allreduces": 8, "05-dead-peer": (0.05, 60.0),
            "07-buckets": 7,
            "08-uneven": (False, "RuntimeError: [...] Timed out waiting 3000ms for recv operation to complete"),
            "09-monitored": ("RuntimeError: [Rank 0]: Rank 1 failed to pass monitoredBarrier in 2000 ms", 1),
            "10-zero-state": 16384 / 18696, "11-exact-w3": (1.5e-08, 4.2e-08)}


def test_every_question_asks_and_reveals_from_a_measurement(capsys):
    assert set(MEASURED) == set(predict.QUESTIONS)
    for qid, value in MEASURED.items():
        q = predict.QUESTIONS[qid]
        assert qid in predict.ask(qid) and f"`{q.variable} = None`" in predict.ask(qid)
        assert predict.reveal(qid, None, value).correct is None  # an unanswered question never raises
        right = q.answer(value)
        assert predict.reveal(qid, right, value).correct is True
        wrong = "z" if q.choices else right + 1
        assert predict.reveal(qid, wrong, value).correct is False
    out = capsys.readouterr().out
    assert "✓ you predicted" in out and "✗ you predicted" in out and "no prediction given" in out


def test_07_buckets_the_count_a_novice_gives_is_judged_wrong_and_told_why(capsys):
    for novice in (8, 26, 52, 1, "8"):  # size over cap, one per layer, one per tensor, one bucket
        assert predict.reveal("07-buckets", novice, 7).correct is False
        out = capsys.readouterr().out
        assert out.startswith(f"✗ you predicted {novice!r}; measured: 7") and "closes it at" in out
    assert predict.reveal("07-buckets", 7, 7).correct is True and predict.reveal("07-buckets", "7", 7).correct
    assert predict.reveal("07-buckets", 7, 8).correct is False  # the measurement decides, not a constant


def test_the_answer_follows_the_measurement_not_a_constant():
    assert predict.reveal("04-allreduces", 8, 2).correct is False  # a run that measured 2 makes 8 wrong
    assert predict.reveal("03-set-epoch", "(A)", True).correct is True
    assert predict.reveal("01-all-reduce", "10", 10.0).correct is True
    assert predict.reveal("10-zero-state", "b", 16384 / 18696).correct is True
    assert predict.reveal("10-zero-state", "b", 0.5).correct is False  # had ZeRO cut every tensor in two, as FSDP2 does
    assert predict.reveal("11-exact-w3", "b", (1.5e-08, 4.2e-08)).correct is True
    assert predict.reveal("11-exact-w3", "b", (0.0, 4.2e-08)).correct is False  # had the run been bit-identical
    assert predict.QUESTIONS["11-exact-w3"].answer((1e-3, 4.2e-08)) == "c"
    with pytest.raises(ValueError, match="no question"):
        predict.ask("99-nothing")


@pytest.mark.parametrize("qid, measured, right, novices_wrong", [
    ("08-uneven", (False, "RuntimeError: Timed out waiting 3000ms for recv operation"), "c", ["a", "b"]),
    ("08-uneven", (True, None), "a", ["c"]),  # a run that finished (with Join, say) makes (c) wrong
    ("08-uneven", (False, "RuntimeError: Connection closed by peer"), "b", ["a", "c"]),
    ("09-monitored", ("[Rank 0]: Rank 1 failed to pass monitoredBarrier in 2000 ms", 1), "b", ["a", "c", "rank 1"]),
    ("09-monitored", ("Timed out waiting 2000ms for recv operation to complete", 1), "c", ["b"]),
    ("09-monitored", ("[Rank 0]: barrier timed out", 1), "a", ["b"]),
])
def test_the_08_and_09_answers_come_from_the_errors_measured(qid, measured, right, novices_wrong):
    assert predict.QUESTIONS[qid].answer(measured) == right
    assert predict.reveal(qid, right.upper(), measured).correct is True
    for wrong in novices_wrong:
        assert predict.reveal(qid, wrong, measured).correct is False


def test_the_zero_state_choices_do_not_explain_the_mechanism():
    # The mechanism (whole tensors) is the reveal's to say, not a choice's.
    assert not any("whole" in c or "cut" in c or "copy" in c for c in predict.QUESTIONS["10-zero-state"].choices.values())


@pytest.mark.parametrize("measured, letter", [
    ((0.03, 60.0), "a"), ((2.0, 60.0), "a"),  # 2 s of a 60 s timeout: at once, not the timeout
    ((61.0, 60.0), "b"), ((2.0, 3.0), "b"),   # with a 3 s timeout, 2 s is the timeout's doing
    ((None, 60.0), "c")])
def test_the_dead_peer_boundaries_come_from_the_timeout_the_run_used(measured, letter):
    assert predict.QUESTIONS["05-dead-peer"].answer(measured) == letter
    assert predict.reveal("05-dead-peer", letter, measured).correct is True


def questions_in(path):
    """(qid, ask cell index, answer cell index, reveal cell index, cells) for each question of a notebook."""
    cells = nbformat.read(path, as_version=4).cells
    code = [i for i, c in enumerate(cells) if c.cell_type == "code"]
    found = []
    for i in code:
        if cells[i].source.startswith("exercises.ask("):
            qid = ast.literal_eval(ast.parse(cells[i].source).body[0].value.args[0])
            answer = next(j for j in code if j > i)
            reveal = next(j for j in code if cells[j].source.startswith(f"exercises.reveal('{qid}'"))
            found.append((qid, i, answer, reveal, cells))
    return found


ALL = [q for path in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")) for q in questions_in(path)]


def test_every_question_is_in_a_notebook():
    assert sorted(q[0] for q in ALL) == sorted(predict.QUESTIONS)


@pytest.mark.parametrize("qid, ask, answer, reveal, cells", ALL, ids=[q[0] for q in ALL])
def test_nothing_before_the_question_answers_it_and_the_reveal_follows_its_measurement(
        qid, ask, answer, reveal, cells):
    before = "\n".join(c.source for c in cells[:ask])
    for giveaway in GIVEAWAYS.get(qid, []):
        assert giveaway not in before, f"{qid}: {giveaway!r} comes before the question"
    call = ast.parse(cells[reveal].source).body[0].value
    assert ask < answer < reveal
    measured_names = {n.id for n in ast.walk(call.args[2]) if isinstance(n, ast.Name)} - {"lessons"}
    previous = max(i for i in range(reveal) if cells[i].cell_type == "code")
    used = {n.id for n in ast.walk(ast.parse(cells[previous].source)) if isinstance(n, ast.Name)}
    assert measured_names & used, f"{qid}: the reveal does not follow the cell that measures it"


def test_a_learner_who_follows_each_question_is_read_once_and_judged():
    """In a kernel: the notebook's own ask and answer cells, the answer in the variable the question names."""
    from nbclient import NotebookClient

    cells, checks = [nbformat.v4.new_code_cell("from ddp_tutorial import exercises")], []
    for qid, ask, answer, reveal, nb_cells in ALL:
        q = predict.QUESTIONS[qid]
        text = predict.ask(qid)
        named = text.split("replace None in `")[1].split(" = None`")[0]
        line = nb_cells[answer].source
        assert line.startswith(f"{named} = None"), f"{qid}: the question names {named!r}, the cell is {line!r}"
        right = q.answer(MEASURED[qid])
        call = ast.parse(nb_cells[reveal].source).body[0].value
        assert ast.unparse(call.args[1]) == named, f"{qid}: the reveal reads {ast.unparse(call.args[1])}"
        call.args[2] = ast.parse(repr(MEASURED[qid])).body[0].value  # the measurement, without its launches
        cells += [nbformat.v4.new_code_cell(nb_cells[ask].source),
                  nbformat.v4.new_code_cell(line.replace("None", repr(right), 1)),
                  nbformat.v4.new_code_cell(ast.unparse(call))]
        checks.append((qid, text))
    nb = nbformat.v4.new_notebook(cells=cells)
    NotebookClient(nb, timeout=60, kernel_name="python3").execute()
    for k, (qid, text) in enumerate(checks):
        asked, answered, revealed = nb.cells[1 + 3 * k: 4 + 3 * k]
        shown = "".join(o.get("text", "") for o in asked.outputs)
        assert shown == text + "\n", f"{qid}: the question should show once:\n{asked.outputs}"
        assert {o.output_type for o in revealed.outputs} == {"stream"}, f"{qid}: {revealed.outputs}"  # no echo
        verdict = "".join(o.text for o in revealed.outputs)
        assert verdict.startswith("✓ you predicted") and "no prediction" not in verdict, f"{qid}: {verdict}"
