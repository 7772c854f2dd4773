"""Process-wide fixes every entry point installs explicitly: `compat.install()` (Python 3.11's
`asyncio.wait_for`) and `tasks.spawn()` (background tasks that are referenced and logged).

Importing this package, or any kvgate package, changes nothing: entry points call `compat.install()`.
"""
