"""Wrong (lab05): hop_fwd computes the hop in plain jnp next to a trivial Pallas kernel that only
copies q. The grader calls the kernel inside its own hop_fwd, so the copy is what it grades.

lab: lab05
expect: o matches the float64 hop oracle
"""
import jax.numpy as jnp


def hop_kernel(q_ref, k_ref, v_ref, qp_ref, kp_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref, *, scale, causal):
    o_ref[...] = q_ref[...]
    lse_ref[...] = jnp.zeros(lse_ref.shape, jnp.float32)


def hop_fwd(q, k, v, q_pos, k_pos, *, scale, causal, block_q, block_kv, interpret):
    h, hk = q.shape[2], k.shape[2]
    k, v = (jnp.repeat(x, h // hk, axis=2) for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        s = jnp.where(q_pos[:, None] >= k_pos[None, :], s, -jnp.inf)
    m = s.max(-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    l = p.sum(-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", p, v) / jnp.where(l > 0, l, 1.0).transpose(0, 2, 1)[..., None]
    return o, jnp.where(l > 0, m[..., 0] + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
