"""How a drafter starts: the data-dependent scaling of its feature-fusion fc (`tap_statistics`, `scale_fc_init`), a
copy of target layers (`init_from_target`), and identity layers appended to a trained drafter (`grow_layers`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.config import DrafterConfig
from specjax.drafter.loader import init_drafter
from specjax.train.batches import SequenceBatches
from specjax.train.features import batch_features


def tap_statistics(target, batches: SequenceBatches, tap_indices, num_batches: int = 2, cache=None) -> jax.Array:
    """Per-input-dimension RMS of the concatenated target taps over a few training batches."""
    total, count = 0.0, 0
    for step in range(num_batches):
        tokens, _, lengths, _, idx = batches.batch(step)
        taps = batch_features(target, tokens, idx, tap_indices, cache)
        valid = (jnp.arange(tokens.shape[1])[None, :] < jnp.asarray(lengths)[:, None])[..., None]
        total = total + jnp.sum(jnp.where(valid, taps * taps, 0.0), axis=(0, 1))
        count += int(lengths.sum())
    return jnp.sqrt(total / max(count, 1))


def scale_fc_init(fc: jax.Array, tap_rms: jax.Array) -> jax.Array:
    """Data-dependent init of the feature fusion fc [in, out]: divide each input row by that input's RMS.

    Small targets have "massive activations" (SmolLM2: one residual dimension with RMS ~3000 where the median
    is ~10); with a plain random fc that single dimension dominates every fused feature, which then carries
    almost no information about the position, and training crawls.  Scaling rows by 1/RMS starts every input
    dimension on an equal footing (the format is unchanged: fc is still a plain linear map of the raw taps).
    """
    scaled = fc / jnp.maximum(tap_rms, 1e-6)[:, None]
    target_rms = jnp.sqrt(jnp.mean(fc * fc))
    return (scaled * target_rms / jnp.sqrt(jnp.mean(scaled * scaled))).astype(fc.dtype)


def init_from_target(params, dcfg: DrafterConfig, target, layers: tuple[int, ...]):
    """Start the drafter as a copy of target layers `layers` (one per drafter layer) reading the tap that feeds
    the first of them: fc selects that tap (identity block, other taps 0), hidden_norm is that layer's input
    norm, so the first drafter layer's context K/V start as the target layer's own; the final norm is the
    target's.  Needs the drafter geometry to equal the target's; per-head q/k norms start at 1 (Llama has none)."""
    tcfg, tw = target.config, target.weights
    if tcfg.tensor_parallel != 1:
        raise ValueError("--init-target-layers needs the target on one device (its fused rows in HF order)")
    if len(layers) != dcfg.num_layers:
        raise ValueError(f"--init-target-layers names {len(layers)} layers for a {dcfg.num_layers}-layer drafter")
    if (dcfg.num_heads, dcfg.num_kv_heads, dcfg.head_dim, dcfg.intermediate_size) != \
            (tcfg.num_heads, tcfg.num_kv_heads, tcfg.head_dim, tcfg.intermediate_size):
        raise ValueError("--init-target-layers needs the drafter's heads / head_dim / intermediate size to equal "
                         "the target's")
    if layers[0] not in dcfg.hidden_state_indices:
        raise ValueError(f"--init-target-layers: the drafter does not tap hidden state {layers[0]} (the input of "
                         f"target layer {layers[0]}); its taps are {list(dcfg.hidden_state_indices)}")
    new_layers = []
    for drafter_layer, i in zip(params.layers, layers):
        t = tw.layers[i]
        q, kv = jnp.split(t.w_qkv.T, [tcfg.q_size], axis=-1)  # target [out, in] -> drafter [in, out]
        new_layers.append(dataclasses.replace(
            drafter_layer, attn_norm=t.attn_norm, w_q=q, w_kv=kv, w_o=t.w_o.T, mlp_norm=t.mlp_norm,
            w_gate_up=t.w_gate_up.T, w_down=t.w_down.T,
            q_norm=t.q_norm if t.q_norm is not None else drafter_layer.q_norm,
            k_norm=t.k_norm if t.k_norm is not None else drafter_layer.k_norm))
    h = dcfg.target_hidden_size
    tap = dcfg.hidden_state_indices.index(layers[0])
    fc = jnp.zeros_like(params.fc).at[tap * h:(tap + 1) * h].set(jnp.eye(h, dtype=params.fc.dtype))
    params = dataclasses.replace(params, layers=tuple(new_layers), fc=fc,
                                 hidden_norm=tw.layers[layers[0]].attn_norm, norm=tw.final_norm)
    # own copies: training donates its params, and the target's arrays (one of them used twice) must survive
    return jax.tree_util.tree_map(lambda a: jnp.array(a, copy=True), params)


def grow_layers(params, dcfg: DrafterConfig, key):
    """Append layers to a trained drafter up to `dcfg.num_layers`, each an identity at first: fresh random
    q/k/v and MLP input matrices but zero output projections (w_o, w_down), so the grown drafter drafts exactly as
    the old one until training moves them (the final norm sees the same residual stream)."""
    extra = dcfg.num_layers - len(params.layers)
    if extra < 0:
        raise ValueError(f"cannot grow a {len(params.layers)}-layer drafter to {dcfg.num_layers} layers")
    if extra == 0:
        return params
    fresh = init_drafter(dataclasses.replace(dcfg, num_layers=extra), key, dtype=params.fc.dtype).layers
    new = tuple(dataclasses.replace(layer, w_o=jnp.zeros_like(layer.w_o), w_down=jnp.zeros_like(layer.w_down))
                for layer in fresh)
    return dataclasses.replace(params, layers=tuple(params.layers) + new)
