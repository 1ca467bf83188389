"""The studio's takes, whoever made them (the web UI, the API, batches, long-form): the one store
(:mod:`~cosyvoice.takes.store`), how each take was made (:mod:`~cosyvoice.takes.provenance`) and their export as
spreadsheets (:mod:`~cosyvoice.takes.export`). Features (the listening-test workbench, long-form) stand on it and
never on each other.
"""
