"""python -m crosscheck and its subcommands (the catalogue, --model, --train, certify)."""
