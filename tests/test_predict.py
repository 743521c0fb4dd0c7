"""Predict-first questions: the answer comes from the measurement, and any prediction is judged against it."""

import pytest

from ddp_tutorial.exercises import predict


def test_every_question_asks_and_reveals_from_a_measurement(capsys):
    measured = {"01-all-reduce": 10.0, "01-wrong-world-size": [0, 1], "02-default-buckets": 2,
                "03-set-epoch": True, "03-padding": 2, "04-allreduces": 8, "05-dead-peer": 0.05,
                "10-zero-state": 16384 / 18696}
    assert set(measured) == set(predict.QUESTIONS)
    for qid, value in measured.items():
        q = predict.QUESTIONS[qid]
        assert qid in predict.ask(qid)
        assert predict.reveal(qid, None, value) is None  # an unanswered question never raises
        right = q.answer(value)
        assert predict.reveal(qid, right, value) is True
        wrong = "z" if q.choices else right + 1
        assert predict.reveal(qid, wrong, value) is False
    out = capsys.readouterr().out
    assert "✓ you predicted" in out and "✗ you predicted" in out and "no prediction given" in out


def test_the_answer_follows_the_measurement_not_a_constant():
    assert predict.reveal("04-allreduces", 8, 2) is False  # a run that measured 2 makes 8 wrong
    assert predict.reveal("05-dead-peer", "a", 0.03) is True
    assert predict.reveal("05-dead-peer", "a", 61.0) is False  # had it waited for the timeout
    assert predict.reveal("03-set-epoch", "(A)", True) is True
    assert predict.reveal("01-all-reduce", "10", 10.0) is True
    assert predict.reveal("10-zero-state", "b", 16384 / 18696) is True
    assert predict.reveal("10-zero-state", "b", 0.5) is False  # had ZeRO cut every tensor in two, as FSDP2 does
    with pytest.raises(ValueError, match="no question"):
        predict.ask("99-nothing")
