"""What a run is, derived once before any data loads (plan): the strategy table (strategies), the memory estimate
(memory, which tools/advise.py prints too), every refusal (checks) and the output directory's state (run_dir: resume
or refuse, and the markers a checkpoint is complete by, which train/'s checkpoints write). It may import model/,
data/ and core/."""
