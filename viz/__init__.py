"""The picture gallery: `python -m viz` renders every example model's plan into viz/gallery/."""
