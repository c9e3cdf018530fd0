"""Speculative decoding: a proposer drafts K tokens per decoding sequence, one forward pass
verifies all K + 1 positions, and the accepted prefix plus one token the target model chose is
appended. The engine's pieces:

- `decoder.SpecDecoder` (called by the scheduler): which sequences draft this step, how many
  (`draft_len`) and what (`propose`: the n-gram index, `ngram.py`, the suffix tries over the
  request and recent requests' outputs, `suffix.py`, whose engine-wide trie takes each finished
  sequence's output (`SpecDecoder.finished`), or a draft model, `draft_model.py`, whose KV pool the
  target's block tables index, so its 1 + K rows are allocated before it proposes); `state.DraftState`: how many tokens a sequence drafts next, adapted to what
  it had accepted, and which of a draft model's KV positions still hold the sequence's tokens;
- the runner returns logits at every row of a drafting sequence (K + 1 rows, not one);
- `verify.verify` (called by the engine core): greedy rows accept the drafts equal to the argmax,
  sampled rows by rejection sampling, so the output distribution is the target model's;
- rollback is bookkeeping only: `num_computed_tokens` counts the accepted positions, the tokens
  appended are the accepted ones, and the blocks that only rejected drafts used go back to the
  pool (`BlockManager.trim`). A rejected draft's KV slot is simply overwritten later; the prefix
  cache hashes full blocks of computed, accepted tokens only, so it never sees one.
- under a grammar (structured output, tools), `grammar.py`: the proposal is cut where the grammar
  refuses it, and each verification row is masked by the grammar state after the drafts before it.
- penalties (repetition, presence, frequency), logit_bias and min_tokens (`Sampler.draft_rows`,
  `engine/penalties.py`): row j is rewritten with the first j drafts counted among the tokens seen,
  the output's counts and its length, as plain decoding would have rewritten it after emitting
  them; greedy accepts a draft iff it is that row's argmax, sampling rejects against that row's
  distribution, so the output stays exact (greedy) or the target's (sampled).
- n > 1: each choice is its own sequence and drafts on its own (its own n-gram index, its own
  tail blocks, its own random stream when seeded: seed + i). Choices share only full prompt
  blocks through the prefix cache; drafts write at positions after the last known token, in the
  choice's own blocks, so no choice ever sees another's draft.
- logprobs (`core._verify`): each emitted token's from its own row's raw logits, before any mask.

- LoRA: a drafting sequence's 1 + K verification rows all run with its adapter. Both runners map
  adapters per scheduled (sequence, tokens) pair, and a drafting sequence's tokens count its
  drafts (`runner._execute_native` -> `lora_batch.native_step`, `runner_torch` -> `row_groups`),
  so a step mixing adapters, the base model and drafts needs nothing more; greedy output is token
  for token the plain engine's (tests/engine/test_spec_lora.py, both paths).

Every request may speculate; whether a step does is the batch rule (`SpecDecoder.allowed`).

A seeded sampled request is reproducible with speculation on, but it draws other random numbers
than with it off (acceptance tests take uniforms), so its tokens differ from the plain engine's
while keeping the same distribution.
"""

