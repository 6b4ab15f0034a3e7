"""The built-in catalogue of `python -m crosscheck`, one module per kind of case.

    seeds      the five seed documents (docs/design.md, "Seed cases")
    torch_nn   torch.nn.MultiheadAttention across its options, F.scaled_dot_product_attention
    relative   relative_attention / shaw_relative_attention and the torchref modules
    flex       flex_attention vs torch's flex, the keywords and the blockwise engine; HF's modern attention
    minilm     the real all-MiniLM-L6-v2 checkpoint vs transformers
    models     whole tiny models (GPT-2, T5, Llama, Qwen2, Mistral, Gemma 2) vs transformers
    positions  position schemes vs torchref.positions and the HF modules that use them
    windows    the 2D relative position bias (Swin, BEiT) vs torchref.windows and transformers' modules
    weights    a state_dict file as a case (`python -m crosscheck --weights FILE`)

Importing a module registers its cases (crosscheck.catalogue.register_case); crosscheck.catalogue.all_cases()
imports them all. What the cases share (seeded numbers, seeded torch modules, the whole-model bar) is in
crosscheck.catalogue.
A new kind is a new module here: the catalogue finds it by its file.
"""
