"""trainer.compile's own rules (its training runs: test_parallel_model.py's compiled layouts and
test_inductor_compiled_blocks_train_like_eager)."""

import logging

import pytest


def _tiny():
    from omegaconf import OmegaConf
    from megalm.config import conf_dir
    from megalm.models.registry import model_config_from
    from megalm.models import build_model
    cfg = model_config_from(OmegaConf.load(f"{conf_dir()}/model/gpt_tiny.yaml"))
    return build_model(cfg, "cpu")


def test_inductor_without_a_cxx_compiler_runs_eagerly_and_says_why(monkeypatch, tmp_path, caplog):
    """On CPU inductor writes C++; with no compiler on PATH the run goes on eagerly with a warning."""
    from megalm.models import family_of
    from megalm.training.compiling import apply_compile
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no g++, no c++
    monkeypatch.delenv("CXX", raising=False)
    model = _tiny()
    with caplog.at_level(logging.WARNING, logger="megalm.training.compiling"):
        assert apply_compile(model, family_of(model.cfg.arch).parts, "blocks", "inductor", "cpu") == 0
    assert "no compiler" in caplog.text and "eagerly" in caplog.text
    assert all(getattr(b, "_compiled_call_impl", None) is None for b in model.blocks.values())


@pytest.mark.parametrize("mode,compiled", [("none", 0), ("model", 1), ("blocks", 2)])
def test_granularity_picks_the_modules(mode, compiled):
    """model: the whole model (one module); blocks: each transformer block (gpt_tiny has 2)."""
    from megalm.models import family_of
    from megalm.training.compiling import apply_compile
    model = _tiny()
    assert apply_compile(model, family_of(model.cfg.arch).parts, mode, "aot_eager", "cpu") == compiled
    targets = [model] if mode == "model" else list(model.blocks.values()) if mode == "blocks" else []
    assert all(t._compiled_call_impl is not None for t in targets)
    assert sum(m._compiled_call_impl is not None for m in model.modules()) == compiled


def test_a_compiled_rope_model_compiles_once_for_training_and_once_for_eval(tmp_path):
    """Dynamo guards on the state a forward reads: a table cached on the first call would fail the guards
    on the second and compile the whole model again. Grad mode is a guard of its own, so evaluation
    (under no_grad) rightly gets a second graph; nothing else may add one."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from configs import load
    from layouts import BASE, LLAMA
    from megalm.train import run
    counters.clear()
    run(load(*BASE, *LLAMA, "model.num_layers=1", "trainer.max_steps=3", "trainer.compile=model",
             "trainer.compile_backend=aot_eager"), tmp_path, 1)
    assert counters["stats"]["unique_graphs"] == 2
    assert not counters["graph_break"]
    torch._dynamo.reset()


@pytest.mark.parametrize("make", ["table", "vocab_parallel"])
def test_a_compiled_lookup_takes_atens_embedding_backward_with_the_same_gradient(make):
    """Compiled, an embedding lookup's backward is aten's kernel (megalm::embedding_grad) instead of the
    scatter of atomic adds inductor would generate: the backward graph, with inductor's decompositions,
    holds the op and no index_put, and the table's gradient is eager's to the bit (the same kernel)."""
    import torch
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._inductor.decomposition import select_decomp_table
    from megalm.models.layers import TableEmbedding
    from megalm.parallel.tensor import VocabParallelEmbedding
    torch.manual_seed(0)
    table = TableEmbedding(64, 8) if make == "table" else VocabParallelEmbedding(64, 8, group=None, reduce="none")
    torch.nn.init.normal_(table.weight)
    ids, gy = torch.randint(0, 64, (4, 33)), torch.randn(4, 33, 8)
    table(ids).backward(gy)
    eager = table.weight.grad
    table.weight.grad = None
    backward = []

    def capture(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=lambda g, _: make_boxed_func(g.forward),
                                     bw_compiler=lambda g, _: backward.append(g) or make_boxed_func(g.forward),
                                     decompositions=select_decomp_table())

    torch.compile(table, backend=capture, fullgraph=True)(ids).backward(gy)
    targets = [str(n.target) for g in backward for n in g.graph.nodes if n.op == "call_function"]
    assert "megalm.embedding_grad.default" in targets and not any("index_put" in t for t in targets), targets
    assert torch.equal(table.weight.grad, eager)


def test_a_compiled_tanh_gelu_is_its_sigmoid_form_with_the_same_values_and_gradients():
    """Inside a compiled graph the tanh GELU is written h * sigmoid(2u) (inductor's tanh is slow on CPU):
    the graph holds a sigmoid and no tanh or gelu, and since 0.5 (1 + tanh u) = sigmoid(2u) exactly, values
    and gradients match F.gelu's tanh approximation to fp64 rounding. Eagerly it is F.gelu itself."""
    import torch
    import torch.nn.functional as F
    from megalm.models.layers import activate
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    h = torch.randn(64, 32, dtype=torch.float64) * 3
    compiled = torch.compile(lambda t: activate(t, "gelu"), backend=capture, fullgraph=True)
    x1, x2 = h.clone().requires_grad_(), h.clone().requires_grad_()
    ours, ref = compiled(x1), F.gelu(x2, approximate="tanh")
    targets = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert any("sigmoid" in t for t in targets), targets
    assert not any("tanh" in t or "gelu" in t for t in targets), targets
    gy = torch.randn_like(h)
    ours.backward(gy)
    ref.backward(gy)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-12, atol=1e-12)
    assert torch.equal(activate(h, "gelu"), F.gelu(h, approximate="tanh"))
    assert torch.equal(activate(h, "gelu_exact"), F.gelu(h))
