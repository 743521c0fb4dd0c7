"""The teacher's tools: grading a class's exercise files (``grade/``) and rendering the notebooks
to pages (``render.py``). A learner's notebooks import none of this."""
