# Runs one `metile` command line and checks its exit code and output, for ctest.
# -DPROGRAM=exe -DARGUMENTS="arg|arg|..." -DEXPECT_EXIT=N
#   [-DEXPECT_STDOUT=exact text] [-DEXPECT_STDOUT_MATCH=regex] [-DEXPECT_STDERR=regex]
# ('|' separates arguments because ';' does not survive add_test's own list splitting.)
string(REPLACE "|" ";" arguments "${ARGUMENTS}")
execute_process(COMMAND ${PROGRAM} ${arguments} RESULT_VARIABLE exit_code OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT exit_code STREQUAL EXPECT_EXIT)
  message(FATAL_ERROR "exit code ${exit_code}, expected ${EXPECT_EXIT}\nstdout: ${out}\nstderr: ${err}")
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
