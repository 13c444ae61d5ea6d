"""The engine side of the store protocol, once for every engine: restores and saves as jobs
with named states (``states``), advanced by one ``Restorer`` and one ``Saver`` against a
``BlockSite`` (where an engine's blocks land and how they are held)."""
