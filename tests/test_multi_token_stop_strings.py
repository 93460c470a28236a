"""The front end's stop strings when one engine delta brings several tokens: the text is cut where the stop string
ends, and the tokens after the one it ended in count for nothing (usage, logprobs)."""

from __future__ import annotations

import pytest

from engine.core.request import StepOutput, TokenLogprob
from server.openai.choices import ChoiceState
from server.tokens import Tokenizer
from tests.model_factory import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer(build_tokenizer(tmp_path_factory.mktemp("tokenizer")))


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_a_stop_string_ending_inside_a_delta_cuts_text_usage_and_logprobs(tokenizer: Tokenizer, chunk: int) -> None:
    tokens = tokenizer.encode("the cat sat on the mat and then it ran away", add_special_tokens=False)
    full = tokenizer.decode(tokens)
    stop = "mat"
    # The token the stop string ends in: the shortest prefix whose text holds it.
    ends_in = next(n for n in range(1, len(tokens) + 1) if stop in tokenizer.decode(tokens[:n]))
    assert ends_in < len(tokens)
    choice = ChoiceState(0, tokenizer, prompt_ids=[], stop=[stop], keep_logprobs=True)
    finish = None
    for start in range(0, len(tokens), chunk):
        part = tokens[start : start + chunk]
        update = choice.consume(
            StepOutput("r", part, new_logprobs=[TokenLogprob(t, -0.5) for t in part], num_prompt_tokens=1)
        )
        if update.finish_reason is not None:
            finish = update.finish_reason
            break
    assert finish == "stop"
    assert choice.full_text == full[: full.index(stop)]
    assert choice.num_tokens == ends_in
    assert [entry.token_id for entry in choice.logprobs] == tokens[:ends_in]
