exec(open('config/_1b.py').read())
residual = 'attnres'
out_dir = 'out/attnres_1b'
wandb_run_name = 'attnres_1b'
