"""The learner's hook (``kernels.base.learner``): a learner's kernel factories, put in place
of the chapter's, are graded by the chapter's own tests; a right answer passes, a wrong one
fails with the smallest case and what went wrong where; a bad file is named."""

from pathlib import Path

import pytest

from kernels.base import learner

FILES = Path(__file__).parent / "learner_files"


# A right answer per file: what grade() prints names the exercises it answers.
RIGHT = {
    "scale_add_right.py": "make_scale_add from scale_add_right.py",
    # ch8: both fragment hooks, read by the PTX mapping (no ldmatrix), inside the production forward
    "tc_fragments_right.py": "make_load_a_fragment, make_p_to_a from tc_fragments_right.py",
    # ch10: Algorithm 1 written out: the oracle and the HBM traffic of Algorithm 1 as written
    "kv_outer_right.py": "make_kv_outer_forward from kv_outer_right.py",
}


@pytest.mark.parametrize("name", RIGHT)
def test_a_right_kernel_passes(name, capsys):
    assert learner.grade(FILES / name)
    out = capsys.readouterr().out
    assert RIGHT[name] in out and "passed:" in out


# A planted learner mistake per file: the file fails its chapter's tests, and what grade()
# prints contains each of the strings (the test, the smallest case, whose element).
MISTAKES = {
    # ch0: the last element is never copied: the message says which one and whose it is
    "copy_stops_short.py": ["not yet:", "smallest failing case:", "elements wrong; the first, element",
                            "block", "thread"],
    "first_softmax_no_max.py": ["test_first_row_softmax_matches_the_oracle", "P (row [b, h, i] is thread"],
    "matmul_shared_tiles_skips_ragged_k.py": ["make_shared_tiles from matmul_shared_tiles_skips_ragged_k.py",
                                              "not yet:", "is wrong (A ", "it is block (", "thread ("],
    # ch3: a device function in place of the course's, inside the production kernel's tree
    "merge_state_no_empty_case.py": ["merge_state from merge_state_no_empty_case.py", "not yet:"],
    # ch4: a row's output not rescaled when its max grows (caught by the pinned large logits)
    "forward_row_no_rescale.py": ["test_row_per_thread_rung_matches_oracle", "O (row [b, h, i] is thread"],
    "forward_tile_ragged_keys.py": ["test_query_tile_rung_matches_oracle", "of block (i // "],
    "backward_row_no_delta.py": ["test_row_per_thread_backward_rung_matches_oracle",
                                 "dQ (row [b, h, r] is make_row_per_thread_dq"],
    "backward_tile_no_causal.py": ["test_shared_tile_backward_rung_matches_oracle", "make_shared_tile_dkdv's thread"],
    "sparse_forward_empty_rows_nan.py": ["test_first_forward_matches_the_oracle",
                                         "NaN entries where the oracle is not NaN", "block t // "],
    "sparse_lists_causal_first_row.py": ["test_first_tile_lists_match_the_host_lists", "count[0, 0] = 6, expected 7",
                                         "block 0, thread 0"],
    # ch7: a learner's split-K combine in place of the production one (decode_attention's
    # plan looks it up): a row whose every piece is empty forms exp(-inf - (-inf)) = NaN
    "decode_combine_no_empty_split.py": ["make_combine from decode_combine_no_empty_split.py", "not yet:",
                                         "NaN entries where the oracle is not NaN", "block (r // "],
    "decode_partial_ignores_cache_length.py": ["test_first_split_k_matches_the_oracle", "the partial blocks"],
    # ch8: the fragment hooks of the production tensor-core forward; each wrong register
    # half is named (lane, register, the element it holds, the one the PTX mapping wants)
    "tc_fragment_rows_swapped.py": ["make_load_a_fragment from tc_fragment_rows_swapped.py", "not yet:",
                                    "lane 0 (group 0, t 0), register a0, low half holds A[8, 0]",
                                    "the mapping puts A[0, 0] there", "rows group and group + 8 swapped?"],
    "tc_p_halves_swapped.py": ["test_p_to_a_follows_the_ptx_mapping", "register a0, low half holds P[0, 1]",
                               "the mapping puts P[0, 0] there", "the two halves of the register swapped?"],
    "tc_p_tiles_swapped.py": ["test_p_to_a_follows_the_ptx_mapping", "register a0, low half holds P[0, 8]",
                              "tiles 2 kp and 2 kp + 1?"],
    # ch10: Algorithm 1 with O_i taken back without its l_i
    "kv_outer_forgets_l_i.py": ["make_kv_outer_forward from kv_outer_forgets_l_i.py", "not yet:",
                                "test_matches_oracle", "smallest failing case:", "in step (K/V tile, query tile"],
}


@pytest.mark.parametrize("name", MISTAKES)
def test_a_planted_mistake_fails_and_says_where(name, capsys):
    assert not learner.grade(FILES / name)
    out = capsys.readouterr().out
    for expected in MISTAKES[name]:
        assert expected in out, f"{name}: {expected!r} not in what grade() printed:\n{out}"


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
