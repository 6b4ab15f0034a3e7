"""crosscheck.propose_layers: a layers= map proposed from execution order, shape and value, checked against
the hand-written map of a family (crosscheck._certificates.faults.llama_layers, the map layer_report uses)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import crosscheck  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    pytest.importorskip("transformers")
    from crosscheck._hf.checkpoints import torch_model, write_checkpoint
    from jaxattn.models import from_pretrained

    directory = write_checkpoint("llama", tmp_path_factory.mktemp("llama"))
    model, params = from_pretrained(directory, dtype="float32", precision="highest")
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 17))
    return model, params, torch_model(directory, "float32"), {"input_ids": ids}


@pytest.mark.slow
def test_the_proposal_for_a_llama_is_its_hand_written_map_and_certifies(llama, capsys):
    """Attention and MLP outputs pair with their blocks (not with the o_proj / down_proj inside, whose output
    is the same array, nor with the norms of the same shape), the final norm with model.norm (not with the
    base model's ModelOutput, whose last_hidden_state it is)."""
    from crosscheck._certificates.faults import jax_llama, llama_layers

    model, params, theirs, inputs = llama
    proposal = crosscheck.propose_layers(theirs, jax_llama(model, params), inputs)
    assert proposal.layers == llama_layers(model.config.num_hidden_layers) and not proposal.unmatched
    assert list(proposal.layers) == list(llama_layers(model.config.num_hidden_layers))  # forward order
    assert all(p.sure and p.normwise < 1e-5 for p in proposal.pairs)
    printed = capsys.readouterr().out
    assert printed.startswith("layers = {\n    'model.embed_tokens': 'embeddings',") and "UNSURE" not in printed
    assert crosscheck.certify(theirs, jax_llama(model, params), inputs, layers=proposal.layers).passed


@pytest.mark.slow
def test_a_port_broken_at_layer_0_attention_still_gets_its_layers_proposed_as_unsure(llama):
    """RoPE on the wrong half of the head: nothing after the embeddings agrees, so every later pair is a
    guess from order and shape, listed apart from the map; here the guesses are right, and certify, given
    them deliberately (layers_with_guesses), names the first divergent layer."""
    from crosscheck._certificates.faults import FAULTS, jax_llama, llama_layers

    model, params, theirs, inputs = llama
    broken = jax_llama(*FAULTS["rope_wrong_half"][0](model, params))
    proposal = crosscheck.propose_layers(theirs, broken, inputs, echo=False)
    assert proposal.layers == {"model.embed_tokens": "embeddings"}
    assert proposal.layers_with_guesses == llama_layers(model.config.num_hidden_layers)
    assert len(proposal.guesses) == len(proposal.pairs) - 1
    assert all("no known transform fits" in p.reason for p in proposal.guesses)
    assert str(proposal).count("#   'model.") == len(proposal.guesses)
    cert = crosscheck.certify(theirs, broken, inputs, layers=proposal.layers_with_guesses)
    assert cert.first_divergent == "model.layers.0.self_attn"


@pytest.mark.parametrize("traceable", [True, False])
def test_nested_blocks_a_module_called_twice_and_an_intermediate_of_no_torch_shape(traceable):
    """block = Sequential(Linear, Tanh): its output is block.1's, and the outer block is proposed. A module
    called twice gives the sequence form of layers=; an intermediate whose shape no module output has is
    listed as unmatched. A jax_fn that leaves JAX for numpy cannot be traced: the values order it then."""
    import jax.numpy as jnp

    torch.manual_seed(0)
    lin = torch.nn.Linear(7, 7).double()

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.block = lin, torch.nn.Sequential(torch.nn.Linear(7, 7), torch.nn.Tanh()).double()

        def forward(self, x):
            return self.lin(self.block(self.lin(x)))

    model = Twice()
    w, b = lin.weight.detach().numpy(), lin.bias.detach().numpy()
    w1, b1 = model.block[0].weight.detach().numpy(), model.block[0].bias.detach().numpy()
    xp = jnp if traceable else np

    def jax_fn(x):
        first = xp.asarray(x) @ w.T + b
        block = xp.tanh(first @ w1.T + b1)
        second = block @ w.T + b
        return second, {"second": second, "pooled": first.sum(-1), "block": block, "first": first}

    x = np.random.default_rng(1).standard_normal((3, 5, 7))
    proposal = crosscheck.propose_layers(model, jax_fn, {"x": x}, dtype="float64", echo=False)
    assert proposal.layers == [("lin", "first"), ("block", "block"), ("lin", "second")]
    assert [p.path for p in proposal.pairs] == ["lin", "block", "lin (call 2)"] and proposal.unmatched == ("pooled",)
    assert all(p.sure and p.normwise < 1e-15 for p in proposal.pairs)
    from crosscheck._certificates.propose import jax_order

    order = jax_order(jax_fn, {"x": x}, None)  # the program's order, not the dict's
    assert (order is not None) == traceable
    assert order is None or sorted(order, key=order.get) == ["first", "block", "second", "pooled"]
    text = str(proposal)
    assert text.startswith("layers = [\n    ('lin', 'first'),") and "# 'pooled': no torch module output" in text


def test_guesses_stay_out_of_the_map_with_the_transform_that_reconciles_them():
    """A correct port with two intermediates torch has no counterpart for: its embedding before the sqrt(E)
    scale torch's embedding module applies (Gemma's), and a residual sum before the post-norm torch's block
    ends with (BERT's). Both are guessed partners and listed apart, each with its transform; the ready map
    holds the sure pair only, and certifies the port."""
    import jax
    import jax.numpy as jnp

    B, T, V, E = 3, 11, 29, 13

    class ScaledEmbedding(torch.nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) * E**0.5

    class PostNormBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(E, E) / E**0.5)
            self.norm = torch.nn.LayerNorm(E)

        def forward(self, x):
            return self.norm(x + torch.tanh(x @ self.weight.T))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.block = ScaledEmbedding(V, E), PostNormBlock()

        def forward(self, input_ids):
            return {"out": self.block(self.embed(input_ids))}

    torch.manual_seed(0)
    model = Model().double()
    with torch.no_grad():
        model.block.norm.weight.add_(0.3 * torch.randn(E, dtype=torch.float64))
        model.block.norm.bias.add_(0.3 * torch.randn(E, dtype=torch.float64))
    w = {k: jnp.asarray(v.detach().numpy()) for k, v in model.state_dict().items()}

    @jax.jit
    def jax_fn(input_ids):
        raw = w["embed.weight"][input_ids]
        x = raw * E**0.5
        total = x + jnp.tanh(x @ w["block.weight"].T)
        mean = total.mean(-1, keepdims=True)
        var = ((total - mean) ** 2).mean(-1, keepdims=True)
        out = (total - mean) / jnp.sqrt(var + 1e-5) * w["block.norm.weight"] + w["block.norm.bias"]
        return {"out": out}, {"embeddings": raw, "residual_sum": total, "block_out": out}

    inputs = {"input_ids": np.random.default_rng(0).integers(0, V, (B, T))}
    proposal = crosscheck.propose_layers(model, jax_fn, inputs, dtype="float64", echo=False)
    assert proposal.layers == {"block": "block_out"}
    guesses = {(p.path, p.name): p.reason for p in proposal.guesses}
    assert set(guesses) == {("embed", "embeddings"), ("block.norm", "residual_sum")}
    assert guesses["embed", "embeddings"].startswith("JAX = 1/sqrt(13) x torch")
    assert guesses["block.norm", "residual_sum"].startswith("torch = layer norm(JAX)")
    text = str(proposal)
    ready, _, listed = text.partition("# guesses, not in the map")
    assert "'block': 'block_out'," in ready and "embeddings" not in ready and "residual_sum" not in ready
    assert "#   'embed': 'embeddings'," in listed and "1/sqrt(13)" in listed
    assert proposal.layers_with_guesses == {"embed": "embeddings", "block.norm": "residual_sum", "block": "block_out"}
    assert crosscheck.certify(model, jax_fn, inputs, dtype="float64", layers=proposal.layers).passed
    broken = crosscheck.certify(model, jax_fn, inputs, dtype="float64", layers=proposal.layers_with_guesses)
    assert broken.first_divergent == "embed"  # what pasting the guesses did before
