"""`python -m models.presets`: the table of presets. A package's `__main__`, so running it does not
execute a module that `import models` has already imported (runpy warns about exactly that)."""

from models.presets import preset_table

print(preset_table())
