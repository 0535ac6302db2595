"""Wire formats: pure data types and (de)serialisation, no trio, no backend."""
