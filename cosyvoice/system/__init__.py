"""What the studio asks of the operating system, below every layer that stores or loads: files written atomically
and a folder's writability (:mod:`~cosyvoice.system.fs`), the stores' SQLite databases
(:mod:`~cosyvoice.system.sqlite`), the allocator's arenas (:mod:`~cosyvoice.system.malloc`)."""
