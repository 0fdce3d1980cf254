"""What ``python -m cfp_megatron.validate`` knows about published runs, as data and the small modules that read it.

``source_settings.yaml`` (what a row's source states outside its tables), ``frameworks.yaml`` (what a blank column
means for each framework), ``model_families.yaml`` (what a model family fixes that no column holds) and
``recipes.yaml`` (Megatron-Bridge's MoE presets by container release), each entry with its source, loaded by
:mod:`.data`; :mod:`.rows` reads a runs file, :mod:`.defaults` resolves a row's source setting, framework, family and
recipe, :mod:`.results` and :mod:`.report` hold the predictions and their figures,
:mod:`.outputs` the files ``--bands``, ``--json`` and ``--plot`` write. See docs/validation.md.
"""
