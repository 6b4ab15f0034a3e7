"""`python -m crosscheck certify --torch MODULE:FACTORY --jax MODULE:FACTORY [--record PATH | --golden PATH]
[--dtype float32|float64] [--grads] [--json PATH] [--plot PNG]`.

Each FACTORY (a function in an importable module, or in a file: path/to/port.py:make) takes no arguments and
returns `(callable, inputs)` or `(callable, inputs, layers)`; inputs {name: numpy array}, layers {torch module
path: JAX intermediate name} (from either factory; given by both, they must agree). --record PATH writes the
torch side to a golden file (and certifies --jax against torch when given); --golden PATH certifies --jax
against that file, without torch (no --torch needed). Prints the certificate; exit 1 naming the first
divergent row; 2 on a usage error.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from collections.abc import Sequence
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m crosscheck certify",
        description="Certify a JAX port of a PyTorch model: every output and named "
        "layer, logits' KL and top-k agreement, optional gradients.",
    )
    p.add_argument("--torch", metavar="MODULE:FACTORY", help="returns (torch callable or nn.Module, inputs[, layers])")
    p.add_argument("--jax", metavar="MODULE:FACTORY", help="returns (JAX callable, inputs[, layers])")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--record", metavar="PATH", help="write torch's side to a golden file (needs --torch)")
    where.add_argument("--golden", metavar="PATH", help="certify --jax against a golden file, without torch")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument(
        "--grads",
        action="store_true",
        help="compare gradients of the loss w.r.t. the float inputs (token ids only: w.r.t. the embeddings)",
    )
    p.add_argument("--json", metavar="PATH", help="write the certificate as JSON ('-': print it instead of the table)")
    p.add_argument("--plot", metavar="PNG", help="draw each row's error / bar (needs matplotlib)")
    return p


def load_factory(spec: str):
    """ "package.module:name" or "path/to/file.py:name" -> the factory's (callable, inputs, layers or None)."""
    module_name, sep, name = spec.rpartition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"expected MODULE:FACTORY, got {spec!r}")
    if module_name.endswith(".py"):
        path = Path(module_name)
        loaded = importlib.util.spec_from_file_location(path.stem, path)
        if loaded is None or not path.is_file():
            raise ValueError(f"{spec}: no file {path}")
        module = importlib.util.module_from_spec(loaded)
        sys.path.insert(0, str(path.parent.resolve()))
        loaded.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    if not hasattr(module, name):
        raise ValueError(f"{spec}: module {module_name!r} has no {name!r}")
    made = getattr(module, name)()
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise ValueError(
            f"{spec}: expected the factory to return (callable, inputs[, layers]), got {type(made).__name__}"
        )
    return made if len(made) == 3 else (*made, None)


def main(argv: Sequence[str]) -> int:
    from crosscheck._certificates.certify import certify
    from crosscheck._certificates.golden import record
    from crosscheck._cli.jax_setup import configure_jax

    parser = _parser()
    args = parser.parse_args(argv)
    if args.jax is None and args.record is None:
        parser.error("--jax MODULE:FACTORY is needed (or --record PATH with --torch, to write a golden file only)")
    if args.torch is None and args.golden is None:
        parser.error("--torch MODULE:FACTORY is needed unless --golden PATH certifies against a golden file")
    configure_jax(None)
    try:
        torch_fn, torch_inputs, torch_layers = load_factory(args.torch) if args.torch else (None, None, None)
        jax_fn, jax_inputs, jax_layers = load_factory(args.jax) if args.jax else (None, None, None)
    except (ImportError, ValueError) as error:
        print(f"python -m crosscheck certify: error: {error}", file=sys.stderr)
        return 2
    if torch_layers is not None and jax_layers is not None and dict(torch_layers) != dict(jax_layers):
        print("python -m crosscheck certify: error: the two factories give different layers", file=sys.stderr)
        return 2
    layers = torch_layers if torch_layers is not None else jax_layers
    inputs = torch_inputs if torch_inputs is not None else jax_inputs
    try:
        if args.record:
            record(torch_fn, inputs, args.record, layers=layers, grads=args.grads, dtype=args.dtype)
            print(f"recorded {args.record}")
            if jax_fn is None:
                return 0
        cert = certify(
            None if args.golden else torch_fn,
            jax_fn,
            inputs,
            dtype=args.dtype,
            layers=layers,
            grads=args.grads,
            golden=args.golden,
        )
    except (ImportError, ValueError, OSError) as error:
        print(f"python -m crosscheck certify: error: {error}", file=sys.stderr)
        return 2
    if args.json:
        text = json.dumps(cert.to_json(), indent=1)
        print(text) if args.json == "-" else Path(args.json).write_text(text + "\n")
    if args.json != "-":
        print(cert.table())
    if args.plot:
        cert.plot(args.plot)
    if not cert.passed:
        print(f"first divergent: {cert.first_divergent}", file=sys.stderr)
        return 1
    return 0
