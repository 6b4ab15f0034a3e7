"""The peer suites (flax's, jax.nn's and torch flex attention's own tests, re-created against jaxattn) run in
full in the slow group (CI runs it); the default group keeps the tests below, one or a few per suite that
cover what a drop-in user relies on first (the layer's numbers and masks, refusals by name, rows with no key),
so that the default group stays under its 4-minute budget (docs/performance.md, "The test suite")."""

from pathlib import Path

import pytest

HERE = Path(__file__).parent

DEFAULT = {
    "test_flax_linen.py": {
        "test_multihead_self_attention",
        "test_causal_mask_and_decoding",
        "test_dtype_infer_and_complex_refused",
        "test_force_fp32_for_softmax",
    },
    "test_flax_nnx.py": {"test_basic", "test_invalid_shapes", "test_gqa_parity_with_jax_and_invalid_heads"},
    "test_jax_nn.py": {
        "test_dot_product_attention_mask",
        "test_row_with_no_allowed_key",
        "test_keywords_refused_by_name",
        "test_bias_gradient",
    },
    "test_torch_flex.py": {
        "test_score_mods",  # its own default list (rel_causal, doc_mask_causal; gradients too)
        "test_fully_masked_rows_and_lse",
        "test_captured_buffer_receives_gradient",
        "test_torch_only_keywords_refused_by_name",
    },
}


def pytest_collection_modifyitems(config, items):
    for item in items:  # the hook sees the whole session's items: only this directory's are sorted here
        kept = DEFAULT.get(item.path.name) if item.path.parent == HERE else None
        if kept is not None and item.originalname not in kept:
            item.add_marker(pytest.mark.slow)
