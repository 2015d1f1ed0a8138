"""The study's sections, one per file: ``section(ctx: StudyContext) -> Section``."""
