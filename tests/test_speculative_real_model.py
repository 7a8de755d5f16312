"""Speculative decoding on the real default model (float32): greedy output identical to plain decoding on
prompts whose answers repeat their text, with drafts accepted."""

from __future__ import annotations

from tests.conftest import requires_default_model
from tokenloop import LLM, SamplingParams
from tokenloop.config import SpeculativeConfig
from tokenloop.observe.records import EngineObserver, StepRecord

pytestmark = requires_default_model

TEXT = ("The committee met on Tuesday to review the budget. It agreed to fund the new library, delay the road "
        "repairs until spring, and hire two more teachers for the primary school.")


class _Drafts(EngineObserver):
    def __init__(self) -> None:
        self.drafts = self.accepted = 0

    def on_step(self, record: StepRecord) -> None:
        self.drafts += record.num_draft_tokens
        self.accepted += record.num_accepted_tokens


def test_greedy_identical_with_ngram_drafts(smollm2_checkpoint) -> None:
    options = dict(checkpoint=smollm2_checkpoint, max_num_seqs=8, max_num_batched_tokens=256, dtype="float32")
    plain = LLM(**options)
    spec = LLM(**options, speculative=SpeculativeConfig(num_speculative_tokens=4))
    drafts = _Drafts()
    spec.engine.add_observer(drafts)
    tokenizer = plain.get_tokenizer()
    asks = [f"Repeat this text word for word: {TEXT}", "Write one sentence about the sea."]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": ask}]) for ask in asks]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == expected
    assert spec.generate(prompts[0], params, use_tqdm=False)[0].outputs[0].token_ids == expected[0]  # alone
    assert drafts.accepted > drafts.drafts // 4 > 0
