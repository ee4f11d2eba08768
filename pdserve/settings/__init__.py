"""Configuration machinery shared by every process: settings declared once on frozen dataclasses."""
