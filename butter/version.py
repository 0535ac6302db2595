"""butter's version, in a module of its own: any layer may read it without importing the
package root (which imports the library and the server)."""

__version__ = "0.1.0"
