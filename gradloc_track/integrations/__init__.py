"""One-line adoption: ``gradloc_track.watch`` and the framework callbacks.

``hf.GradLocCallback`` (transformers.Trainer) and ``lightning.GradLocCallback`` (Lightning
Trainer) are imported from their own modules, so ``transformers``/``lightning`` load only there.
"""
