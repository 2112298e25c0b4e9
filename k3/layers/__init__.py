"""The K3 layer families, one per file: norm, mlp, conv, kda, mla, attn_res, moe, balancing."""
