exec(open('config/_1b.py').read())
residual = 'delta_attnres'
out_dir = 'out/delta_attnres_1b'
wandb_run_name = 'delta_attnres_1b'
