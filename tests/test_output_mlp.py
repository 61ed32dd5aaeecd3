"""``output_mlp``: a decoder layer after attention (the output projection, the residual add and the MLP's norm, the
gated MLP, Gemma 3's norms after the projections) as one graph node of our CPU kernels. It must give the bits of the
three ``qmatmul_many`` nodes it stands for, on every weight form a GGUF file gives, and the float64 value of the
formula within float32 rounding; bad arguments are refused with a message naming what was wrong."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from mlx_engine.mlx import cpu_kernels  # noqa: E402
from mlx_engine.weights import quant  # noqa: E402
from tests.test_codebook_weights import blocks as codebook_blocks  # noqa: E402
from tests.test_weights_gguf import k_quant_blocks  # noqa: E402

pytestmark = [pytest.mark.usefixtures("mlx_on_the_cpu"),
              pytest.mark.skipif(cpu_kernels.output_mlp is None, reason="the CPU kernels are not built here")]

D, K_O, F = 256, 512, 768  # hidden size, the attention output's width (heads * head size), the MLP's width


def weight(type_name: str, rows: int, cols: int, seed: int):
    """A ``[rows, cols]`` weight of a GGUF type as its repack holds it: (the kernel's argument tuple, the float64
    dense values)."""
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name in quant.CODEBOOK_TYPES:
        blk = codebook_blocks(type_name, rows, cols, seed)
    elif type_name.endswith("_K"):
        blk = k_quant_blocks((rows, cols), qtype, seed).reshape(-1).view(quant.BLOCKS[type_name])
    else:
        x = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
        blk = gguf.quants.quantize(x, qtype).reshape(-1).view(quant.BLOCKS[type_name])
    qa = quant.repack_gguf(blk, type_name, rows, cols)
    arg = (mx.array(qa.weight), mx.array(qa.scales), None if qa.biases is None else mx.array(qa.biases),
           qa.group_size, qa.bits, None if qa.super_scales is None else mx.array(qa.super_scales),
           cpu_kernels.codebook_id(qa.codebook))
    return arg, qa.dequantize().astype(np.float64)


def apart(o, h, ws, norm, act, eps, o_norm, down_norm, activations):
    """The three nodes ``output_mlp`` stands for, as the model runs them without it."""
    many = cpu_kernels.qmatmul_many

    def cols(*args):
        return [list(x) for x in zip(*args)]

    (wo, so, bo, go, bto, sup_o, cb_o), gate, up, down = ws
    y = many(o.reshape(*h.shape[:-1], -1), [wo], [so], [bo], [go], [bto], None, activations, "none", [], [o_norm],
             eps, [sup_o], [cb_o])[0]
    w, s, b, g, bits, sup, cb = cols(gate, up)
    total, gv, uv = many(h, w, s, b, g, bits, None, activations, "add_norm", [y, norm], None, eps, sup, cb)
    w, s, b, g, bits, sup, cb = cols(down)
    return total, many(gv, w, s, b, g, bits, None, activations, act, [uv], [down_norm], eps, sup, cb)[0]


def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def formula(o, h, dense, norm, act, eps, o_norm, down_norm):
    """The layer in float64 (the transformers formulas: LlamaMLP, Gemma3's sandwich norms)."""
    o, h = np.array(o, np.float64).reshape(-1, K_O), np.array(h, np.float64).reshape(-1, D)
    y = o @ dense[0].T
    if o_norm is not None:
        y = rms(y, np.array(o_norm, np.float64), eps)
    s = h + y
    x = rms(s, np.array(norm, np.float64), eps)
    g, u = x @ dense[1].T, x @ dense[2].T
    a = g / (1 + np.exp(-g)) if act == "silu" else 0.5 * g * (1 + np.tanh(0.7978845608028654 * (g + 0.044715 * g ** 3)))
    m = (a * u) @ dense[3].T
    if down_norm is not None:
        m = rms(m, np.array(down_norm, np.float64), eps)
    return s, m


KINDS = {
    "Q4_1": ("Q4_1", "Q4_1", "Q4_1", "Q4_1"),  # smollm2's file: affine 4-bit, float16 scales and biases
    "Q4_K_M": ("Q4_K", "Q5_0", "Q8_0", "Q6_K"),  # gemma3's mix: two levels, symmetric 5 and 8 bits, groups of 16
    "IQ4": ("IQ4_XS", "IQ4_NL", "IQ4_XS", "Q5_K"),
}


def _activations() -> list[str]:
    return ["float32"] + [k for k in ("int8", "int16") if cpu_kernels.activations_problem(k) is None]


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("rows", [1, 3, 20])
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_output_mlp_gives_the_bits_of_its_nodes_apart(kind, rows, gemma):
    shapes = ((D, K_O), (F, D), (F, D), (D, F))
    made = [weight(t, r, c, seed) for seed, (t, (r, c)) in enumerate(zip(KINDS[kind], shapes))]
    ws, dense = [a for a, _ in made], [d for _, d in made]
    keys = iter(mx.random.split(mx.random.key(rows), 5))
    # one token's attention output as [1, H, 1, Dh]; several rows as [1, N, H * Dh]
    o = mx.random.normal((1, 8, 1, 64) if rows == 1 else (1, rows, K_O), key=next(keys))
    h = mx.random.normal((1, rows, D), key=next(keys)) * 4
    norm, o_norm, down_norm = (mx.random.normal((D,), key=next(keys)) for _ in range(3))
    act, eps = ("gelu_tanh", 1e-6) if gemma else ("silu", 1e-5)
    o_norm, down_norm = (o_norm, down_norm) if gemma else (None, None)
    for activations in _activations():
        s, m = cpu_kernels.output_mlp(o, h, ws[0], norm, ws[1], ws[2], ws[3], act, eps, o_norm, down_norm,
                                      activations)
        assert s.shape == m.shape == h.shape and s.dtype == m.dtype == mx.float32
        s_want, m_want = apart(o, h, ws, norm, act, eps, o_norm, down_norm, activations)
        assert mx.array_equal(s, s_want).item() and mx.array_equal(m, m_want).item(), activations
    # and the value of the formula (float32 activations: only the sums' rounding differs)
    s, m = cpu_kernels.output_mlp(o, h, ws[0], norm, ws[1], ws[2], ws[3], act, eps, o_norm, down_norm)
    s64, m64 = formula(o, h, dense, norm, act, eps, o_norm, down_norm)
    np.testing.assert_allclose(np.array(s).reshape(-1, D), s64, rtol=1e-5, atol=1e-5 * np.abs(s64).max())
    np.testing.assert_allclose(np.array(m).reshape(-1, D), m64, rtol=1e-4, atol=1e-4 * np.abs(m64).max())


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_output_mlp_with_the_next_layers_input_gives_the_bits_of_its_nodes_apart(kind, rows, qk_norm):
    """With the next layer's input norm and projections as a fourth stage (a decode step's layer boundary as one
    node): the sum s + m, and q, k, v in the heads' shapes (one token) with Qwen3 / Gemma 3's per-head norms, each
    the bits of output_mlp and then qmatmul_many's add_norm node."""
    shapes = ((D, K_O), (F, D), (F, D), (D, F), (K_O, D), (128, D), (128, D))
    types = KINDS[kind] + (KINDS[kind][0], KINDS[kind][1], KINDS[kind][0])
    ws = [weight(t, r, c, seed)[0] for seed, (t, (r, c)) in enumerate(zip(types, shapes))]
    keys = iter(mx.random.split(mx.random.key(10 + rows), 6))
    o = mx.random.normal((1, 8, 1, 64) if rows == 1 else (1, rows, K_O), key=next(keys))
    h = mx.random.normal((1, rows, D), key=next(keys)) * 4
    norm, next_norm = (mx.random.normal((D,), key=next(keys)) for _ in range(2))
    q_norm, k_norm = (mx.random.normal((64,), key=next(keys)) for _ in range(2))
    out_shapes = [[1, 8, 1, 64], [1, 2, 1, 64], [1, 2, 1, 64]] if rows == 1 else None
    norms = [q_norm, k_norm, None] if qk_norm and rows == 1 else None
    for activations in _activations():
        s, m = cpu_kernels.output_mlp(o, h, ws[0], norm, ws[1], ws[2], ws[3], "silu", 1e-5, None, None, activations)
        cols = [list(x) for x in zip(*ws[4:])]
        want = cpu_kernels.qmatmul_many(s, *cols[:5], out_shapes, activations, "add_norm", [m, next_norm], norms,
                                        1e-5, cols[5], cols[6])
        got = cpu_kernels.output_mlp(o, h, ws[0], norm, ws[1], ws[2], ws[3], "silu", 1e-5, None, None, activations,
                                     next_norm, ws[4:], out_shapes, norms)
        assert len(got) == 4 and [g.shape for g in got] == [w.shape for w in want]
        assert all(mx.array_equal(g, w).item() for g, w in zip(got, want)), activations
        if rows == 1:
            assert got[1].shape == (1, 8, 1, 64)


def test_bad_arguments_are_refused_with_what_was_wrong():
    shapes = ((D, K_O), (F, D), (F, D), (D, F))
    ws = [weight("Q4_1", r, c, seed)[0] for seed, (r, c) in enumerate(shapes)]
    o, h, norm = mx.zeros((1, 1, K_O)), mx.zeros((1, 1, D)), mx.ones((D,))

    def call(**change):
        args = dict(o=o, h=h, wo=ws[0], norm=norm, gate=ws[1], up=ws[2], down=ws[3], activation="silu", eps=1e-5,
                    o_norm=None, down_norm=None)
        args.update(change)
        return cpu_kernels.output_mlp(**args)

    cases = [
        (dict(activation="relu"), "activation must be silu or gelu_tanh"),
        (dict(activations="int4"), 'activations must be "float32", "int8" or "int16"'),
        (dict(o=mx.zeros((1, 1, K_O), mx.float16)), "o and h must be float32"),
        (dict(o=mx.zeros((1, 1, K_O + 32))), f"o must hold h's rows of the output projection's {K_O} inputs"),
        (dict(norm=mx.ones((D + 1,))), f"the MLP's norm weight must be float32 \\[{D}\\]"),
        (dict(o_norm=mx.ones((7,))), f"o_norm must be float32 \\[{D}\\]"),
        (dict(down_norm=mx.ones((D,), mx.float16)), f"down_norm must be float32 \\[{D}\\]"),
        (dict(gate=ws[3]), "x's last axis must be"),  # a gate that does not take D inputs
        (dict(up=weight("Q4_1", F - 32, D, 9)[0]), "the gate and up projections must have as many outputs"),
        (dict(wo=weight("Q4_1", D + 32, K_O, 9)[0]), f"the output projection must give h's {D} features"),
        (dict(down=weight("Q4_1", D - 32, F, 9)[0]), f"the down projection must give h's {D} features"),
        (dict(wo=(*ws[0][:4], 7, *ws[0][5:])), "bits must be 2, 3, 4, 5, 6 or 8"),
        # the next layer's input: its norm weight and weights together, of h's width, shapes that hold the products
        (dict(next=[ws[1]]), "the next layer takes its norm weight and one or more weights"),
        (dict(next_norm=norm), "the next layer takes its norm weight and one or more weights"),
        (dict(next_norm=norm, next=[ws[1]], next_shapes=[[1], [2]]), "one or more weights"),
        (dict(next_norm=mx.ones((D + 1,)), next=[ws[1]]), f"the next layer's norm weight must be float32 \\[{D}\\]"),
        (dict(next_norm=norm, next=[ws[3]]), "x's last axis must be"),  # a weight that does not take D inputs
        (dict(next_norm=norm, next=[ws[1]], next_shapes=[[1, 1, 7]]), f"output shape 0 has 7 elements, the product "
                                                                      f"has {F}"),
        (dict(next_norm=norm, next=[ws[1]], next_shapes=[[1, -1, -F]]), "an output shape has a negative size"),
        (dict(next_norm=norm, next=[ws[1]], next_norms=[mx.ones((3,))]),
         f"a next layer's output norm must be float32 \\[{F}\\]"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            call(**change)
    s, m = call(o=mx.zeros((1, 0, K_O)), h=mx.zeros((1, 0, D)))  # no rows: empty results
    assert s.shape == m.shape == (1, 0, D) and s.size == m.size == 0


def test_product_nodes_keep_constant_weights_and_stay_apart_under_compile():
    """A product node keeps the evaluated constants among its inputs (a model's weights: each graph input costs MLX
    time at every call of a compiled step) instead of as graph inputs; two nodes alike but for the weights they keep
    must not be merged by compile's common-subexpression pass, and the same weights given as a compiled function's
    arguments (tracers: graph inputs) give the same bits."""
    import io
    import re

    keys = iter(mx.random.split(mx.random.key(3), 4))
    w1, w2 = (mx.quantize(mx.random.normal((64, 128), key=next(keys)), group_size=32, bits=4) for _ in range(2))
    x = mx.random.normal((1, 128), key=next(keys))
    mx.eval(w1, w2, x)

    def two(x, a, b):
        return (cpu_kernels.qmatmul(x, *a, 32, 4), cpu_kernels.qmatmul(x, *b, 32, 4))

    want = [np.array(x) @ (np.array(mx.dequantize(*w, group_size=32, bits=4)).T) for w in (w1, w2)]
    eager = two(x, w1, w2)
    closed = mx.compile(lambda x: two(x, w1, w2))(x)  # constants: kept by the nodes
    traced = mx.compile(lambda x, *ws: two(x, ws[:3], ws[3:]))(x, *w1, *w2)  # arguments: graph inputs
    for got in (eager, closed, traced):
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.array(g), w, rtol=1e-5, atol=1e-4)
        assert all(mx.array_equal(g, e).item() for g, e in zip(got, eager))
    dot = io.StringIO()
    mx.export_to_dot(dot, *two(x, w1, w2))
    nodes = re.findall(r'\{ (\d+) \[label ="MLXEngineQMatmul"', dot.getvalue())
    assert len(nodes) == 2
    for node in nodes:  # x alone goes in: no weight among the graph's edges
        assert len(re.findall(rf'"\w+" -> {node}\n', dot.getvalue())) == 1


def test_the_self_test_checks_output_mlp_and_the_layer_boundary():
    """The load-time self-test passes on the built kernel and names what differs on one that errs: in the node's own
    stages, or in the next layer's input (a decode step's layer boundary)."""
    from mlx_engine.mlx import _kernels

    real = _kernels.output_mlp
    assert cpu_kernels._output_mlp_self_test(real, _kernels.qmatmul_many) is None

    def wrong_boundary(*a):  # the next layer's first two outputs swapped
        r = real(*a)
        return [r[0], r[2], r[1], *r[3:]] if len(a) > 12 else r

    def wrong_mlp(*a):  # the MLP's output off by one ulp-sized step
        r = real(*a)
        return r if len(a) > 12 else [r[0], r[1] * (1 + 2 ** -20)]

    assert "next layer's input differs" in cpu_kernels._output_mlp_self_test(wrong_boundary, _kernels.qmatmul_many)
    assert "differs from its products apart" in cpu_kernels._output_mlp_self_test(wrong_mlp, _kernels.qmatmul_many)
