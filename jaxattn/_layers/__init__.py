"""Multi-head attention on a parameter tree (functional), the decode cache, the logic the linen and nnx
shells share, and placement of params/inputs on a device mesh."""
