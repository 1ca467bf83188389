"""Long-form narration and dialogue: projects with an editable segment table, takes, finishing, export.

``script`` turns documents and dialogue scripts into segment rows (with the frontend's own splitter),
``store`` keeps projects, segments and which takes each segment has (the takes themselves are the studio's one
take store's, :mod:`cosyvoice.takes.store`), ``finishing`` trims, levels, mixes and writes subtitles; ``editor``,
``rendering``, ``mix``, ``delivery`` and ``exports`` own a project's editing, its render job, its mix, its ACX
delivery and its exports (jobs too), and ``projects.LongformStudio`` wires them over the service. Adapters:
``cosyvoice.server.longform`` (REST + page) and ``cosyvoice.tools.longform`` (CLI).
"""

from cosyvoice.longform.mix import Rendered, Timeline
from cosyvoice.longform.projects import LongformStudio
from cosyvoice.longform.store import Project, ProjectStore, Segment, Take

__all__ = ["LongformStudio", "Project", "ProjectStore", "Rendered", "Segment", "Take", "Timeline"]
