exec(open('config/_8b.py').read())
residual = 'attnres'
out_dir = 'out/attnres_8b'
wandb_run_name = 'attnres_8b'
