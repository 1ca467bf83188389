"""The listening-test workbench: batch takes with provenance, blind tests for raters, statistics.

Built on :class:`cosyvoice.service.TTSService` like every other adapter; persisted in one SQLite database and a
folder of take audio files in the data folder (:func:`cosyvoice.settings.default_data_dir`).
"""
