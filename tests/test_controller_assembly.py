"""controller.assembly.rollout_rows: engine rollouts in the trainer's row layout."""

from types import SimpleNamespace

import numpy as np
import pytest

from rlax_tpu.controller.assembly import rollout_rows


def test_rollout_rows_put_each_log_prob_where_its_token_is_the_target():
    r = SimpleNamespace(prompt_tokens=(5, 6, 7), tokens=(8, 9), logprobs=(-0.5, -0.25))
    tokens, mask, behaviour = rollout_rows([r], 6)
    assert tokens.tolist() == [[5, 6, 7, 8, 9, 0]]
    assert mask.tolist() == [[False, False, True, True, False, False]]
    assert np.array_equal(behaviour, [[0, 0, -0.5, -0.25, 0, 0]])
    # Each masked position's target (the next token) is a response token.
    assert tokens[0, 1:][mask[0, :-1]].tolist() == [8, 9]
    with pytest.raises(ValueError, match="rollout 0 has 5 tokens; the rows hold 4"):
        rollout_rows([r], 4)
