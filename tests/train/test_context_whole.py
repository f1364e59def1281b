"""The context axis says which rows it leaves whole (`jaxtune.train.shapes.BatchShapes`): a batch whose length
``mesh.context`` does not divide runs each row whole on every device of the context group. At start the lengths
concerned are named with their count, the first batch of such a length is a warning with its rows, and the end says
how many of the rows stepped ran whole (summary.json too: tests/train/test_context_parallel.py's runs)."""

from __future__ import annotations

from jaxtune.config import load_config
from jaxtune.data.buckets import bucket_length
from jaxtune.train.shapes import BatchShapes, Shape


def _shapes(context: int, seq_len: int = 64) -> BatchShapes:
    cfg = load_config("finetune-quickstart", [f"data.seq_len={seq_len}", "data.length_buckets=4"])
    return BatchShapes.of(cfg, context=context)


def test_the_start_names_the_lengths_the_axis_does_not_divide():
    shapes = _shapes(8)
    lengths = sorted({bucket_length(n, 64, 4) for n in range(1, 65)})  # 16, 20, 24, 28, 32, 40, 48, 56, 64
    odd = [n for n in lengths if n % 8]
    assert odd == [20, 28]
    (note,) = shapes.context_notes()
    assert note.startswith(f"warning: mesh.context=8 does not divide 2 of the {len(lengths)} lengths a batch may be "
                           "cut to (20, 28): ")
    assert _shapes(4).context_notes() == [] and _shapes(1).context_notes() == []  # 4 divides every bucket here
    assert _shapes(1).whole_note() is None


def test_batches_run_whole_are_said_once_and_counted():
    shapes, said = _shapes(8), []
    lengths = [20, 32, 20, 28, 64]  # batches of 4 rows
    for step, length in enumerate(lengths, 1):
        assert shapes.step(lambda: "trained", Shape(length, 3 * length, 4 * length), step, said.append) == "trained"
    warnings = [s for s in said if s.startswith("warning:")]
    assert warnings == [
        ("warning: step 1: batches of 20 positions do not divide by mesh.context=8, so their 4 rows run whole on "
         "each device of the context group (not split)"),
        ("warning: step 4: batches of 28 positions do not divide by mesh.context=8, so their 4 rows run whole on "
         "each device of the context group (not split)")]  # the second batch of 20 is counted, not said again
    assert (shapes.whole_rows, shapes.rows) == (12, 20)
    assert shapes.whole_note() == ("mesh.context=8: 12 of the 20 rows stepped ran whole (their batch's length did "
                                   "not divide by 8)")
