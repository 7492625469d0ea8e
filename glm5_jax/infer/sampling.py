"""Token sampling from fp32 logits with per-slot settings: greedy, temperature, top-k, top-p.

The settings are arrays (`SamplingParams`, one value per slot), so one compiled program serves
slots with different settings, and a slot takes a new request without a recompile. Hand-written
because no maintained JAX library offers per-row top-k/top-p with a fixed tie rule and a
per-request random stream (optax and flax have none; `jax.random.categorical` is the only
primitive used).

The sampling distribution of a slot with temperature `t`, top_k `k`, top_p `p` over logits `z`:

  1. Order the vocabulary by `z` descending, ties to the LOWER token id (+0.0 and -0.0 tie).
     The order depends on `z` only, not on `t`, so it is the same at every temperature.
  2. t == 0 (greedy): all mass on the first token of that order (the argmax, lowest id among
     equal maxima); top_k and top_p are ignored. Its log-prob is 0.
  3. Otherwise scale: `s = (z - max z) / t` (subtracting the max first keeps tiny `t` finite:
     the max maps to 0, the rest towards -inf).
  4. top-k (k == 0 or k >= Y: off): keep exactly the first k tokens of the order; ties at the
     boundary go to the lower ids, so exactly k tokens survive.
  5. top-p (p >= 1: off): over the top-k survivors, renormalized, keep the shortest prefix of
     the order whose probability mass is >= p: token j is kept iff the mass of the tokens before
     it in the order is < p. The first token is always kept. (The usual definition of nucleus
     sampling, applied after temperature and top-k as HF transformers and vLLM do.)
  6. The distribution is `softmax(s)` over the kept tokens, exactly 0 (log-prob -inf) elsewhere.

Randomness: token n of a request (n = 0 for its first generated token) is drawn with the key
`fold_in(fold_in(key(seed), n), stream)` (`token_keys`), from the request's seed and n only,
never from the slot index or the rest of the batch, so a request gives the same tokens whatever
batch it lands in. `stream` separates the independent draws speculative decoding needs for one
token: SAMPLE (the token itself; plain sampling uses it), DRAFT (the MTP draft), ACCEPT (the
rejection test's uniform).

Logits must have at least one finite value per row (-inf entries are fine: masked tokens).

Notation (docs/design.md): B slots, Q tokens per slot in one call, Y vocab.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

SAMPLE, DRAFT, ACCEPT = 0, 1, 2  # random streams of one token (module docstring)


class SamplingParams(NamedTuple):
  """Per-slot settings, each `[B]`: temperature fp32 (0 = greedy), top_k int32 (0 = off),
  top_p fp32 (1 = off). A pytree, so it passes through jit as arrays."""

  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array

  @classmethod
  def create(cls, batch: int, temperature=0.0, top_k=0, top_p=1.0) -> "SamplingParams":
    """Settings for `batch` slots; each argument a scalar (all slots) or a `[batch]` sequence."""
    return cls(jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (batch,)),
               jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (batch,)),
               jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (batch,)))


class Sampled(NamedTuple):
  """Sampled tokens, each array shaped like the logits without Y (`[B]` or `[B, Q]`).

  tokens: int32 ids. logprobs: fp32 log-prob under the sampling distribution (0 for greedy).
  raw_logprobs: fp32 log-prob under the raw model, `log_softmax(logits)` at temperature 1.
  """

  tokens: jax.Array
  logprobs: jax.Array
  raw_logprobs: jax.Array


def token_keys(seed, index, stream: int = SAMPLE):
  """Typed PRNG keys shaped like `index`: `fold_in(fold_in(key(seed), n), stream)` per entry.

  Args:
    seed: uint32 request seeds, `[B]` (broadcast against `index`'s leading axis).
    index: int32 token indices within each request, `[B]` or `[B, Q]`.
    stream: SAMPLE, DRAFT or ACCEPT.
  """
  index = jnp.asarray(index, jnp.int32)
  seed = _along(jnp.asarray(seed, jnp.uint32), index.shape)

  def one(s, n):
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(s), n), stream)

  keys = jax.vmap(one)(seed.reshape(-1), index.reshape(-1))
  return keys.reshape(index.shape)


def sampling_logprobs(logits, params: SamplingParams):
  """Log-probabilities of the sampling distribution (module docstring), -inf outside it.

  Args:
    logits: fp32 `[B, Y]` or `[B, Q, Y]`.
    params: per-slot settings `[B]` (shared by a slot's Q positions).
  Returns:
    fp32, shaped like `logits`.
  """
  lead, y = logits.shape[:-1], logits.shape[-1]
  z_NY = logits.astype(jnp.float32).reshape(-1, y)
  t_N, k_N, p_N = (_along(v, lead).reshape(-1) for v in params)
  greedy_N = t_N == 0
  t_N = jnp.where(greedy_N, 1.0, t_N)
  ids_NY = jax.lax.broadcasted_iota(jnp.int32, z_NY.shape, 1)
  argmax_N = jnp.argmax(jnp.where(z_NY == 0, 0.0, z_NY), axis=-1)  # first max; +0.0 == -0.0
  onehot_NY = jnp.where(ids_NY == argmax_N[:, None], 0.0, -jnp.inf)
  plain_NY = jax.nn.log_softmax((z_NY - jnp.max(z_NY, -1, keepdims=True)) / t_N[:, None])
  filters_N = ~greedy_N & (((k_N > 0) & (k_N < y)) | (p_N < 1))
  # The sort costs O(Y log Y) per row; skip it when no slot filters. Each row's value depends
  # only on its own settings (unfiltered rows always take `plain`), so batch neighbours never
  # change a row's numbers.
  filtered_NY = jax.lax.cond(jnp.any(filters_N),
                             lambda: _filtered_logprobs(z_NY, t_N, k_N, p_N),
                             lambda: plain_NY)
  out_NY = jnp.where(greedy_N[:, None], onehot_NY,
                     jnp.where(filters_N[:, None], filtered_NY, plain_NY))
  return out_NY.reshape(logits.shape)


def _filtered_logprobs(z_NY, t_N, k_N, p_N):
  """Steps 1 and 3-6 of the module docstring for rows with t > 0; `[N, Y]`."""
  ids_NY = jax.lax.broadcasted_iota(jnp.int32, z_NY.shape, 1)
  # Sorting by (-z, id) puts ties in id order; +0.0 and -0.0 must compare equal first.
  neg_NY, order_NY = jax.lax.sort((-jnp.where(z_NY == 0, 0.0, z_NY), ids_NY), num_keys=2)
  sorted_NY = -neg_NY
  scaled_NY = (sorted_NY - sorted_NY[:, :1]) / t_N[:, None]
  rank_NY = ids_NY  # position in the order
  keep_k_NY = (k_N[:, None] <= 0) | (rank_NY < k_N[:, None])
  top_k_NY = jnp.where(keep_k_NY, scaled_NY, -jnp.inf)
  probs_NY = jax.nn.softmax(top_k_NY, axis=-1)
  mass_before_NY = jnp.pad(jnp.cumsum(probs_NY, axis=-1)[:, :-1], ((0, 0), (1, 0)))
  keep_NY = keep_k_NY & ((mass_before_NY < p_N[:, None]) | (p_N[:, None] >= 1))
  keep_NY |= rank_NY == 0
  kept_NY = jnp.where(keep_NY, top_k_NY, -jnp.inf)
  logprobs_sorted_NY = kept_NY - jax.nn.logsumexp(kept_NY, axis=-1, keepdims=True)
  # Back to vocabulary order: order_NY is a permutation of each row.
  return jax.vmap(lambda o, v: jnp.zeros_like(v).at[o].set(v, unique_indices=True))(
      order_NY, logprobs_sorted_NY)


def sample(logits, params: SamplingParams, seed, index, stream: int = SAMPLE) -> Sampled:
  """Draws one token per row of `logits` from its sampling distribution.

  Args:
    logits: fp32 `[B, Y]` or `[B, Q, Y]`.
    params: per-slot settings `[B]`.
    seed: uint32 `[B]`, each slot's request seed.
    index: int32, shaped like `logits` without Y: the token index within the request that each
      row's token will have (token n draws with `token_keys(seed, n, stream)`).
    stream: SAMPLE for generated tokens, DRAFT for MTP drafts.
  Returns:
    `Sampled` (tokens, logprobs, raw_logprobs), each shaped like `index`.
  """
  lead, y = logits.shape[:-1], logits.shape[-1]
  if jnp.shape(index) != lead:
    raise ValueError(f"index has shape {jnp.shape(index)}; expected logits' leading shape {lead}")
  logprobs_NY = sampling_logprobs(logits, params).reshape(-1, y)
  keys_N = token_keys(seed, index, stream).reshape(-1)
  tokens_N = jax.vmap(jax.random.categorical)(keys_N, logprobs_NY).astype(jnp.int32)
  # Only the argmax has a finite log-prob in a greedy row, so categorical returns it anyway;
  # taking it explicitly keeps greedy independent of the random stream by construction.
  greedy_N = _along(params.temperature, lead).reshape(-1) == 0
  tokens_N = jnp.where(greedy_N, jnp.argmax(logprobs_NY, axis=-1), tokens_N).astype(jnp.int32)
  raw_NY = jax.nn.log_softmax(logits.astype(jnp.float32).reshape(-1, y))
  return Sampled(tokens_N.reshape(lead), take_token(logprobs_NY, tokens_N).reshape(lead),
                 take_token(raw_NY, tokens_N).reshape(lead))


def take_token(values_NY, tokens_N):
  """`values[..., token]` for each row: `[..., Y]`, `[...]` -> `[...]`."""
  return jnp.take_along_axis(values_NY, tokens_N[..., None].astype(jnp.int32), axis=-1)[..., 0]


def _along(values_B, lead):
  """Broadcast per-slot `[B]` values over a leading shape `[B, ...]`."""
  values_B = jnp.asarray(values_B)
  return jnp.broadcast_to(values_B.reshape(values_B.shape + (1,) * (len(lead) - 1)), lead)
