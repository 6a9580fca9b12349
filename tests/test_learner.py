"""The learner's hook (``kernels.base.learner``): a learner's kernel factories, put in place
of the chapter's, are graded by the chapter's own tests; a right answer passes, a wrong one
fails with the smallest case and what went wrong where; a bad file is named."""

from pathlib import Path

import pytest

from kernels.base import learner

FILES = Path(__file__).parent / "learner_files"


def test_a_right_kernel_passes(capsys):
    assert learner.grade(FILES / "scale_add_right.py")
    out = capsys.readouterr().out
    assert "make_scale_add from scale_add_right.py" in out and "passed:" in out


def test_a_copy_that_stops_short_fails_naming_the_element_block_and_thread(capsys):
    assert not learner.grade(FILES / "copy_stops_short.py")
    out = capsys.readouterr().out
    assert "not yet:" in out and "smallest failing case:" in out        # (an explicit or a drawn example)
    # the last element is never copied: the message says which one and whose it is
    assert "elements wrong; the first, element" in out and "block" in out and "thread" in out


def test_chapter_1s_first_softmax_without_the_max_fails(capsys):
    assert not learner.grade(FILES / "first_softmax_no_max.py")
    out = capsys.readouterr().out
    assert "test_first_row_softmax_matches_the_oracle" in out and "P (row [b, h, i] is thread" in out


def test_chapter_3s_device_merge_without_the_empty_case_fails(capsys):
    """A device function in place of the course's, inside the production kernel's tree."""
    assert not learner.grade(FILES / "merge_state_no_empty_case.py")
    out = capsys.readouterr().out
    assert "merge_state from merge_state_no_empty_case.py" in out and "not yet:" in out


def test_a_file_without_its_chapter_or_exercises_is_named(tmp_path):
    nothing = tmp_path / "mine.py"
    nothing.write_text("x = 1\n")
    with pytest.raises(ValueError, match="CHAPTER"):
        learner.load(nothing)
    nothing.write_text('CHAPTER = "gpu_basics"\n')
    with pytest.raises(ValueError, match="make_scale_add, make_block_max, make_copy, make_block_sum"):
        learner.load(nothing)
    with pytest.raises(FileNotFoundError, match="WORKBOOK_LEARNER"):
        learner.load(tmp_path / "absent.py")


def test_chapter_4s_first_rung_without_rescaling_o_fails(capsys):
    """A row's output not rescaled when its max grows: caught by the pinned large logits."""
    assert not learner.grade(FILES / "forward_row_no_rescale.py")
    out = capsys.readouterr().out
    assert "test_row_per_thread_rung_matches_oracle" in out and "O (row [b, h, i] is thread" in out


def test_chapter_4s_second_rung_sweeping_a_ragged_tile_whole_fails(capsys):
    assert not learner.grade(FILES / "forward_tile_ragged_keys.py")
    out = capsys.readouterr().out
    assert "test_query_tile_rung_matches_oracle" in out and "of block (i // " in out


def test_chapter_5s_first_rung_without_d_fails(capsys):
    assert not learner.grade(FILES / "backward_row_no_delta.py")
    out = capsys.readouterr().out
    assert "test_row_per_thread_backward_rung_matches_oracle" in out and "dQ (row [b, h, r] is make_row_per_thread_dq" in out


def test_chapter_5s_second_rung_ignoring_causal_fails(capsys):
    assert not learner.grade(FILES / "backward_tile_no_causal.py")
    out = capsys.readouterr().out
    assert "test_shared_tile_backward_rung_matches_oracle" in out and "make_shared_tile_dkdv's thread" in out


def test_chapter_6s_first_forward_without_the_empty_rows_fails(capsys):
    assert not learner.grade(FILES / "sparse_forward_empty_rows_nan.py")
    out = capsys.readouterr().out
    assert "test_first_forward_matches_the_oracle" in out and "NaN entries where the oracle is not NaN" in out
    assert "block t // " in out


def test_chapter_6s_lists_with_the_causal_test_on_the_first_row_fail(capsys):
    assert not learner.grade(FILES / "sparse_lists_causal_first_row.py")
    out = capsys.readouterr().out
    assert "test_first_tile_lists_match_the_host_lists" in out and "count[0, 0] = 6, expected 7" in out
    assert "block 0, thread 0" in out


def test_chapter_7s_combine_without_the_empty_case_fails(capsys):
    """A learner's split-K combine in place of the production one (decode_attention's plan
    looks it up): a row whose every piece is empty forms exp(-inf - (-inf)) = NaN."""
    assert not learner.grade(FILES / "decode_combine_no_empty_split.py")
    out = capsys.readouterr().out
    assert "make_combine from decode_combine_no_empty_split.py" in out and "not yet:" in out
    assert "NaN entries where the oracle is not NaN" in out and "block (r // " in out


def test_chapter_7s_first_partial_past_the_cache_length_fails(capsys):
    assert not learner.grade(FILES / "decode_partial_ignores_cache_length.py")
    out = capsys.readouterr().out
    assert "test_first_split_k_matches_the_oracle" in out and "the partial blocks" in out


def test_chapter_2s_shared_tiles_that_skip_the_ragged_k_tile_fail(capsys):
    assert not learner.grade(FILES / "matmul_shared_tiles_skips_ragged_k.py")
    out = capsys.readouterr().out
    assert "make_shared_tiles from matmul_shared_tiles_skips_ragged_k.py" in out and "not yet:" in out
    assert "is wrong (A " in out and "it is block (" in out and "thread (" in out
