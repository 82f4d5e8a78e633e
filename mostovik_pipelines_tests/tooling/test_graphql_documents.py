"""Every GraphQL document the tests send to the webserver is valid against the schema of the
installed Dagster webserver: a fragment spread where its type can never be, or a field the
schema does not have, fails here, before a test waits on a webserver to say so."""

from __future__ import annotations

import pytest
from dagster_graphql.schema import create_schema
from graphql import parse, validate

from mostovik_pipelines_tests.support import graphql_queries

DOCUMENTS = {name: value for name, value in vars(graphql_queries).items()
             if name.endswith(("_QUERY", "_MUTATION"))}


@pytest.fixture(scope="module")
def schema():
    return create_schema().graphql_schema


def test_the_documents_are_all_found():
    assert len(DOCUMENTS) >= 18, sorted(DOCUMENTS)


@pytest.mark.parametrize("name", sorted(DOCUMENTS))
def test_the_document_is_valid_against_the_webservers_schema(schema, name):
    assert [error.message for error in validate(schema, parse(DOCUMENTS[name]))] == []
