"""LoRA adapters on pipeline stages, through PEFT (an optional dependency: ``pip install 'hf-noloco[peft]'``).

- :mod:`~hf_noloco.adapters.settings`: the ``LoraConfig`` from TRL's option names, what a run records of it;
- :mod:`~hf_noloco.adapters.stage`: adapters added to one stage's own layers, everything else frozen;
- :mod:`~hf_noloco.adapters.consensus`: the mean of a stage's adapters over its replicas (a collective);
- :mod:`~hf_noloco.adapters.files`: the export, a PEFT adapter folder or the merged model.
"""
