exec(open('config/_paper.py').read())
n_embd, n_layer, n_head, n_kv_head = 768, 12, 12, 4
intermediate_size = 4 * n_embd
