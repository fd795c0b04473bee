# Runs one command line for ctest and checks its exit code and output; the one
# checker behind every CLI test (metile_add_command_test in command_test.cmake).
#   cmake -DCOMMAND="program|arg|..." -DEXPECT_EXIT=N
#         [-DEXPECT_STDOUT=exact text, without the final newline]
#         [-DEXPECT_STDOUT_MATCH=regex on stdout ('.' matches newlines too)]
#         [-DEXPECT_STDERR=regex] [-DALLOW_MULTILINE_STDERR=ON]
#         -P expect_command.cmake
# ('|' separates arguments because ';' does not survive add_test's own list splitting.)
# Always checked besides: a successful run writes nothing to stderr, and a failed
# one writes exactly one line there (the CLI's "metile: error: ..."), unless
# ALLOW_MULTILINE_STDERR is set (CLI11's usage errors add a hint line).
string(REPLACE "|" ";" command "${COMMAND}")
execute_process(COMMAND ${command} RESULT_VARIABLE exit_code OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT exit_code STREQUAL "${EXPECT_EXIT}")
  message(FATAL_ERROR "exit code ${exit_code}, expected ${EXPECT_EXIT}\nstdout:\n${out}\nstderr:\n${err}")
endif()
if(exit_code STREQUAL "0" AND NOT err STREQUAL "")
  message(FATAL_ERROR "a successful run wrote to stderr:\n${err}")
endif()
if(NOT exit_code STREQUAL "0" AND NOT ALLOW_MULTILINE_STDERR)
  string(REGEX MATCHALL "\n" newlines "${err}")
  list(LENGTH newlines line_count)
  if(NOT line_count EQUAL 1)
    message(FATAL_ERROR "stderr has ${line_count} lines, expected one:\n${err}")
  endif()
endif()
if(DEFINED EXPECT_STDOUT AND NOT out STREQUAL "${EXPECT_STDOUT}\n")
  message(FATAL_ERROR "stdout was\n${out}\nexpected\n${EXPECT_STDOUT}")
endif()
if(DEFINED EXPECT_STDOUT_MATCH AND NOT out MATCHES "${EXPECT_STDOUT_MATCH}")
  message(FATAL_ERROR "stdout was\n${out}\nexpected to match\n${EXPECT_STDOUT_MATCH}")
endif()
if(DEFINED EXPECT_STDERR AND NOT err MATCHES "${EXPECT_STDERR}")
  message(FATAL_ERROR "stderr was\n${err}\nexpected to match\n${EXPECT_STDERR}")
endif()
